"""An EAGLE head over the flat batch: one pass through its pool (`head_pass`), and a chain's
draft round as one function of tensors (`head_round`).

`head_round` is what both `EagerHeadRound` and the CUDA graphs (engine/executor/head_graphs.py) run: the feed, then
steps 2 .. S one token a row, sampling with a temperature alone from staged uniforms; `AheadFeed` is a round drafted
ahead. docs/speculation.md, "An EAGLE head"."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds, build_batch, next_step
from infer.models.batch import ForwardBatch
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.layers.paged_attention import BatchView
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.transfer import to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


def run_head(head: EagleHead, pool: CachePoolProtocol, batch: ForwardBatch, features: torch.Tensor,
             kernels: Kernels = EAGER) -> torch.Tensor:
    """The head's outputs [N, H] over a batch (its K/V written to the pool); features [N, H]."""
    view = BatchView(pool.k_cache, pool.v_cache, batch, pool.arrivals)
    return head(batch.token_ids[None], features[None], batch.rope_positions[None], view, kernels)[0]


def head_pass(head: EagleHead, pool: CachePoolProtocol, plan: BatchPlan, features: torch.Tensor,
              ids: torch.Tensor | None = None, kernels: Kernels = EAGER) -> torch.Tensor:
    """One head forward over a plan's rows: features [N, H], ids [N] on the device (None: the plan's)
    -> the outputs at the plan's logits tokens [M, H]; the pool's lengths set to the rows' ends."""
    batch = build_batch(plan, pool.tables, pool.block_size, pool.scratch_row, features.device)
    if ids is not None:
        batch.token_ids.copy_(ids)
    x = run_head(head, pool, batch, features, kernels)
    for slot, end in plan.ends:
        pool.set_length(slot, end)
    return x.index_select(0, batch.logits_indices)


@dataclass(frozen=True)
class AheadFeed:
    """A round drafted ahead: its feed's ids [N] and each row's accepted count [R] (it drafts after
    its first accepted + 1 fed tokens), both on the device; `shift` [R]: each row's start moved on
    the device (following a round in flight, `DeviceIds.shift`)."""

    ids: torch.Tensor  # [N] long
    accepted: torch.Tensor  # [R] long
    shift: torch.Tensor | None = None  # [R] long

    def device_ids(self) -> DeviceIds:
        """The feed's ids and row moves, for the feed's batch arrays."""
        n = self.ids.shape[0]
        return DeviceIds(tuple(range(n)), self.ids, grid=(n, 0, n), shift=self.shift)


def drafting_from(feed: ForwardBatch, accepted: torch.Tensor | None) -> tuple[torch.Tensor, ForwardBatch]:
    """(the feed's token index each row drafts from [R], the batch its first step follows): each
    row's last token, or with `accepted` [R] its token accepted[b], the row ending just after it."""
    rows = feed.seq_lens.shape[0]
    if accepted is None:
        return feed.logits_indices[:rows], feed
    starts, ends = feed.query_start[:rows], feed.query_start[1:rows + 1]
    picks = (starts + accepted).clamp(max=feed.token_ids.shape[0] - 1)  # [R]
    lens = torch.where(feed.seq_lens > 0, feed.seq_lens - (ends - starts) + accepted + 1, 0)  # [R]
    return picks, replace(feed, seq_lens=lens)


def head_round(head: EagleHead, pool: CachePoolProtocol, feed: ForwardBatch, features: torch.Tensor, steps: int,
               sampling: torch.Tensor | None, context_width: int, kernels: Kernels = EAGER,
               accepted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """feed: R rows, logits at each row's last token; features [N, H]; sampling: float64
    [2 + steps, R] temperature | greedy | one uniform per step, None when every row is greedy;
    context_width: a bound on every step's contexts; accepted [R]: a round drafted ahead.
    Returns (tokens [R, steps], probs [R, steps, V] or None) on the device."""
    picks, feed_end = drafting_from(feed, accepted)
    x = run_head(head, pool, feed, features, kernels).index_select(0, picks)  # [R, H]
    tokens, probs = [], []
    for s in range(steps):
        logits = head.logits(x, kernels)  # [R, V]
        if sampling is None:
            new = greedy_tokens(logits)  # [R]
        else:
            p = temperature_probs(logits, sampling[0].float(), sampling[1] > 0.5)  # [R, V]
            new = sample_from_probs(p, sampling[2 + s])
            probs.append(p)
        tokens.append(new)
        if s + 1 == steps:
            break
        x = run_head(head, pool, next_step(feed_end, new, s, pool.scratch_row, context_width), x, kernels)
    return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)


def round_sampling(temperatures: Sequence[float], greedy: Sequence[bool],
                   uniforms: torch.Tensor) -> torch.Tensor:
    """The float64 [2 + steps, n] sampling block `head_round` reads (CPU; uniforms [n, steps])."""
    return torch.cat([torch.tensor([list(temperatures), [float(g) for g in greedy]], dtype=torch.float64),
                      uniforms.t().to(torch.float64)])


class HeadRoundFn(Protocol):
    """A head's draft round (`head_round`) on its pool; eager or a CUDA graph replay."""

    kernels: Kernels  # the head's bundle its rounds run

    def __call__(self, plan: BatchPlan, features: torch.Tensor, steps: int, temperatures: Sequence[float],
                 uniforms: torch.Tensor, greedy: Sequence[bool],
                 ahead: AheadFeed | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """plan: the feed's rows, one logit a row; features [N, H] on the device; uniforms CPU float64
        [B, steps] (unread when all greedy) -> (tokens [B, steps], probs [B, steps, V] or None); each
        row's slot ends steps - 1 positions past its feed (`end_round`)."""
        ...

    def prepare(self, widths: Iterable[int], steps: Iterable[int], ahead: bool = False) -> None:
        """Capture rounds of these feed widths and step counts before use (graphs only); `ahead`:
        also the greedy rounds drafted ahead."""
        ...


def check_round(plan: BatchPlan, features: torch.Tensor, steps: int) -> None:
    ends = plan.arrays["query_start"][1:] - 1
    if steps < 1 or features.shape[0] != plan.num_tokens or plan.num_logits != plan.num_rows \
            or (plan.arrays["logits"] != ends).any():
        raise ValueError(f"a head round needs steps >= 1, features for each of the feed's {plan.num_tokens} tokens "
                         f"and one logit a row at its last token; got {steps} steps, {features.shape[0]} features, "
                         f"logits at {plan.arrays['logits'].tolist()}")


def end_round(pool: CachePoolProtocol, plan: BatchPlan, steps: int) -> None:
    """Each row's slot holds its feed and the round's fed drafts: steps - 1 past the feed."""
    for slot, end in plan.ends:
        pool.set_length(slot, end + steps - 1)


class EagerHeadRound:
    """`HeadRoundFn` run eagerly: the feed's batch built, then `head_round` with `kernels`."""

    def __init__(self, head: EagleHead, pool: CachePoolProtocol, kernels: Kernels = EAGER) -> None:
        self.head, self.pool, self.kernels = head, pool, kernels
        self.device = next(head.parameters()).device

    def __call__(self, plan: BatchPlan, features: torch.Tensor, steps: int, temperatures: Sequence[float],
                 uniforms: torch.Tensor, greedy: Sequence[bool],
                 ahead: AheadFeed | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_round(plan, features, steps)
        pool = self.pool
        feed = build_batch(plan, pool.tables, pool.block_size, pool.scratch_row, self.device,
                           None if ahead is None else ahead.device_ids())
        sampling = None if all(greedy) else to_device(round_sampling(temperatures, greedy, uniforms), self.device)
        out = head_round(self.head, pool, feed, features, steps, sampling, plan.context_width + steps - 1,
                         self.kernels, None if ahead is None else ahead.accepted)
        end_round(pool, plan, steps)
        return out

    def prepare(self, widths: Iterable[int], steps: Iterable[int], ahead: bool = False) -> None:
        pass
