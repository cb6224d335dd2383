"""CUDA graphs of an EAGLE head's draft rounds (`speculative/eagle_round.head_round`).

`HeadRoundGraphs` captures a whole round per (rows, tokens, steps, every row greedy, drafted
ahead); anything else runs eagerly through the same function (`EagerHeadRound`).
`make_head_round` builds either. docs/architecture.md, "EAGLE heads".
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from infer.cache.forward_batch import BatchPlan
from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.batch_forward import kernels_serve_model
from infer.engine.executor.capture import CAPTURE_SIZES, capture_sizes, graph_context_width
from infer.engine.executor.staging import PlanInputs, Staging, record_graph, stage_sampling
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.kernels.routes import AttentionRoutes
from infer.speculative.eagle_round import AheadFeed, EagerHeadRound, check_round, end_round, head_round

log = logging.getLogger("infer.engine")

Key = tuple[int, int, int, bool, bool]  # (rows, tokens, steps, every row greedy, drafted ahead)


@dataclass
class _RoundGraph:
    graph: torch.cuda.CUDAGraph
    inputs: PlanInputs  # the feed's plan arrays: T tokens over R rows
    floats: Staging | None  # float64 [2 + steps, R]: temperature | greedy | uniforms; None when greedy
    features: torch.Tensor  # [T, H] static input
    tokens: torch.Tensor  # [R, steps]
    probs: torch.Tensor | None  # [R, steps, V]; None in a greedy round
    accepted: torch.Tensor | None  # [R] static input of a round drafted ahead (else None)


def token_bucket(n: int) -> int | None:
    """The capture size holding n tokens (None: more than the largest)."""
    return next((b for b in CAPTURE_SIZES if b >= n), None)


class HeadRoundGraphs:
    """`HeadRoundFn` by CUDA graph replays."""

    def __init__(self, head: EagleHead, pool: CachePoolProtocol, max_batch_size: int, sampling_batch_max: int,
                 context_width: int | None = None, kernels: Kernels = EAGER) -> None:
        self.head, self.pool, self.kernels = head, pool, kernels
        self.device = next(head.parameters()).device
        self.eager = EagerHeadRound(head, pool, kernels)
        self.context_width = context_width or graph_context_width(pool.max_seq_len)
        # row buckets (none where the attention kernels do not serve the head: every round eager)
        self.rows = ([b for b in capture_sizes(max_batch_size) if b <= sampling_batch_max]
                     if kernels_serve_model(head) else [])  # type: ignore[arg-type]
        self.graphs: dict[Key, _RoundGraph] = {}
        self.stream = torch.cuda.Stream(self.device)
        self.replays = 0

    def prepare(self, widths: Iterable[int], steps: Iterable[int], ahead: bool = False) -> None:
        """Capture now every round of feeds up to max(widths) tokens a row, for each row bucket,
        step count, greedy or sampled (`ahead`: also greedy rounds drafted ahead)."""
        widest, steps = max(widths), list(steps)
        for rows in self.rows:
            tokens = {token_bucket(max(n, rows)) for n in range(rows, rows * widest + 1)}
            keys = list(itertools.product([rows], sorted(t for t in tokens if t is not None), sorted(set(steps)),
                                          (True, False), (False,)))
            whole = token_bucket(rows * widest)
            if ahead and whole is not None:
                keys.append((rows, whole, max(steps), True, True))
            for key in keys:
                if key not in self.graphs:
                    self.graphs[key] = self._capture(*key)

    def key(self, plan: BatchPlan, steps: int, greedy: bool, ahead: bool = False) -> Key | None:
        """The graph serving a round (None: it runs eagerly)."""
        rows = next((r for r in self.rows if r >= plan.num_rows), None)
        widest = max(plan.query_lens)
        if rows is None or plan.context_width + steps - 1 > self.context_width \
                or not AttentionRoutes.split_kv_only(widest, None) or (ahead and not greedy):
            return None
        tokens = token_bucket(rows * widest if ahead else max(plan.num_tokens, rows))
        return None if tokens is None else (rows, tokens, steps, greedy, ahead)

    def __call__(self, plan: BatchPlan, features: torch.Tensor, steps: int, temperatures: Sequence[float],
                 uniforms: torch.Tensor, greedy: Sequence[bool],
                 ahead: AheadFeed | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_round(plan, features, steps)
        key = self.key(plan, steps, all(greedy), ahead is not None)
        if key is None:
            return self.eager(plan, features, steps, temperatures, uniforms, greedy, ahead)
        g = self.graphs.get(key)
        if g is None:  # (a stall of the steps in flight: `prepare` should have captured it)
            log.warning("EAGLE head round graph %s captured on first use", key)
            g = self.graphs[key] = self._capture(*key)
        g.inputs.stage(plan)
        n = plan.num_rows
        if g.floats is not None:
            stage_sampling(g.floats, n, temperatures, greedy, uniforms)
            g.floats.send()
        if ahead is not None:
            assert g.accepted is not None
            ahead.device_ids().apply(g.inputs.parts, plan.num_tokens)
            g.accepted[:n].copy_(ahead.accepted)
        g.features[:plan.num_tokens].copy_(features)
        self.pool.tables.sync()  # (the graph reads the tables' device tensor in place)
        g.graph.replay()
        end_round(self.pool, plan, steps)
        self.replays += 1
        return g.tokens[:n], (None if g.probs is None else g.probs[:n])

    @torch.inference_mode()
    def _capture(self, rows: int, tokens: int, steps: int, greedy: bool, ahead: bool) -> _RoundGraph:
        inputs = PlanInputs(tokens, rows, self.device)  # (capture inputs: every token padding)
        dtype = next(self.head.parameters()).dtype
        features = torch.zeros((tokens, self.head.spec.hidden_size), dtype=dtype, device=self.device)
        floats = None
        if not greedy:
            floats = torch.full((2 + steps, rows), 0.5, dtype=torch.float64, device=self.device)
            floats[:2] = 1.0  # temperature 1, greedy
        accepted = torch.zeros(rows, dtype=torch.long, device=self.device) if ahead else None
        tables = self.pool.tables.sync()  # (updated in place: the graph reads it at each replay)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            feed = inputs.batch(tables, self.pool.block_size, self.pool.scratch_row, self.context_width, 0)
            return head_round(self.head, self.pool, feed, features, steps, floats, self.context_width, self.kernels,
                              accepted)

        graph, (out, probs) = record_graph(run, self.stream, self.device)
        return _RoundGraph(graph, inputs, None if floats is None else Staging(floats), features, out, probs, accepted)


def make_head_round(head: EagleHead, pool: CachePoolProtocol, use_cuda_graphs: bool, max_batch_size: int,
                    sampling_batch_max: int, kernels: Kernels = EAGER) -> HeadRoundGraphs | EagerHeadRound:
    """The head's round function: CUDA graphs where asked for on a CUDA device, else eager."""
    if use_cuda_graphs and next(head.parameters()).device.type == "cuda":
        return HeadRoundGraphs(head, pool, max_batch_size, sampling_batch_max, kernels=kernels)
    return EagerHeadRound(head, pool, kernels)
