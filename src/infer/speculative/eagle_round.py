"""An EAGLE head's draft round as one function of tensors: the last catch-up feed, then the draft steps.

`head_round` is what both the eager path and CUDA graphs run (engine/executor/head_graphs.py
captures this same function), so the graphs are tested equal to it:

1. the feed: each row's last l_b <= w pending features with the tokens after them, padded
   to width w; the head's output at each row's last fed position (`last`) gives draft 1;
2. steps 2 .. k: one position each, feeding the head's own output of the step before and
   the token it drafted.

Every position the round writes is one column of a single *union* layout per row (the l_b
fed positions, then one per later step; the last draft is not fed), whose indices are
filled once: step s reads its column `last + s` of them. Feed columns past a row's l_b
write positions that the later steps overwrite before anything reads them. Tokens are
sampled with a temperature alone (greedy rows: argmax) from the head's distribution over
target ids (`EagleHead.logits`), with staged uniforms; rows needing other transforms,
penalties or grammars take the proposer's general path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from infer.cache.view import BatchLayout, CacheView, ViewIndices
from infer.models.eagle import EagleHead
from infer.models.kernels import EAGER, Kernels
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


def head_round(head: EagleHead, k_cache: torch.Tensor, v_cache: torch.Tensor, ids: torch.Tensor,
               features: torch.Tensor, indices: ViewIndices, last: torch.Tensor, steps: int,
               sampling: torch.Tensor | None, keep_probs: bool,
               kernels: Kernels = EAGER) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [n, w], features [n, w, H] (the feed, padded), indices: the union layout's on the
    device (W = w + steps - 1 columns), last [n]: each row's last fed column; sampling: float64
    [2 + steps, n] temperature | greedy | one uniform per step, None when every row is greedy
    (argmax); kernels: the head's bundle (fused on the GPU's fixed-shape rounds). Returns
    (tokens [n, steps], probs [n, steps, V] or None) on the device."""
    n, w = ids.shape
    width = indices.q_pos.shape[1]
    write = indices.write_rows.view(n, width)
    positions = indices.q_pos[:, :w]  # [n, w]
    end = indices.q_pos.gather(1, last[:, None])[:, 0] + 1  # [n]
    view = CacheView(k_cache, v_cache, ViewIndices(write[:, :w].reshape(-1), indices.gather_rows, positions, end))
    x = head(ids, features, positions, view, kernels)  # [n, w, H]
    x = x.gather(1, last[:, None, None].expand(n, 1, x.shape[-1]))[:, 0]  # [n, H]
    tokens, probs = [], []
    for s in range(steps):
        logits = head.logits(x, kernels)  # [n, V]
        if sampling is None:
            new = greedy_tokens(logits)  # [n]
        else:
            p = temperature_probs(logits, sampling[0].float(), sampling[1] > 0.5)  # [n, V]
            new = sample_from_probs(p, sampling[2 + s])
            if keep_probs:
                probs.append(p)
        tokens.append(new)
        if s + 1 == steps:
            break
        column = (last + s + 1)[:, None]  # [n, 1]
        pos = indices.q_pos.gather(1, column)  # [n, 1]
        view = CacheView(k_cache, v_cache, ViewIndices(write.gather(1, column).reshape(-1), indices.gather_rows,
                                                       pos, pos[:, 0] + 1))
        x = head(new[:, None], x[:, None], pos, view, kernels)[:, 0]
    return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)


def round_sampling(temperatures: Sequence[float], greedy: Sequence[bool],
                   uniforms: torch.Tensor) -> torch.Tensor:
    """The float64 [2 + steps, n] sampling block `head_round` reads (CPU; uniforms [n, steps])."""
    return torch.cat([torch.tensor([list(temperatures), [float(g) for g in greedy]], dtype=torch.float64),
                      uniforms.t().to(torch.float64)])


class HeadRoundFn(Protocol):
    """A head's draft round (`head_round`) on its pool; eager or a CUDA graph replay."""

    def __call__(self, ids: torch.Tensor, features: torch.Tensor, layout: BatchLayout, last: Sequence[int],
                 steps: int, temperatures: Sequence[float], uniforms: torch.Tensor,
                 greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids CPU [n, w]; features [n, w, H] on the device; layout: the union (row b
        `last[b] + steps` long from its cache end, width w + steps - 1); uniforms CPU float64
        [n, steps] (unread when every row is greedy). Returns (tokens [n, steps], probs
        [n, steps, V] or None when every row is greedy); the pool ends committed to the union."""
        ...

    def prepare(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        """Capture the rounds of these feed widths and step counts ahead of use (graphs only)."""
        ...


def check_round(ids: torch.Tensor, layout: BatchLayout, last: Sequence[int], steps: int) -> None:
    n, w = ids.shape
    if steps < 1 or layout.width != w + steps - 1 or len(last) != n or max(last) != w - 1 or min(last) < 0:
        raise ValueError(f"a head round of feed width {w} and {steps} steps needs a union layout {w + steps - 1} "
                         f"wide and each row's last fed column (the widest w - 1); got width {layout.width}, "
                         f"last {list(last)}")
    if layout.chunk_lens != tuple(x + steps for x in last):
        raise ValueError(f"head round: row lengths {layout.chunk_lens} must be last + steps")


class EagerHeadRound:
    """`HeadRoundFn` run eagerly: the union's indices filled once, then `head_round` with
    `kernels` (the fused bundle as the fallback of CUDA graphs, EAGER elsewhere)."""

    def __init__(self, head: EagleHead, pool: CachePoolProtocol, kernels: Kernels = EAGER) -> None:
        self.head, self.pool, self.kernels = head, pool, kernels
        self.device = next(head.parameters()).device

    def __call__(self, ids: torch.Tensor, features: torch.Tensor, layout: BatchLayout, last: Sequence[int],
                 steps: int, temperatures: Sequence[float], uniforms: torch.Tensor,
                 greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_round(ids, layout, last, steps)
        indices = self.pool.indices(layout).to(self.device)
        sampling = None if all(greedy) else to_device(round_sampling(temperatures, greedy, uniforms), self.device)
        out = head_round(self.head, self.pool.k_cache, self.pool.v_cache, to_device(ids, self.device), features,
                         indices, tensor_on(list(last), self.device, torch.long), steps, sampling, keep_probs=True,
                         kernels=self.kernels)
        self.pool.commit(layout)
        return out

    def prepare(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        pass
