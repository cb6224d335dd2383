"""CUDA graphs of an EAGLE head's draft rounds: `speculative/eagle_round.head_round` captured whole.

A head's draft step is one small decoder layer: run eagerly through the eager kernels it
is some twenty launches, so its time is launch-bound, not weight-bound. The round runs the
head's kernel bundle (`step_kernels` of the head: the fused one with CUDA graphs on a GPU,
as the target's decode steps: the MLP and the final norm + lm_head as GEMVs with their
prologues and epilogues), and `GraphHeadRound` captures a whole
round (the last catch-up feed, padded to width w, then steps - 1 one-token steps, each
sampling on the device) per (batch bucket, w, steps, every row greedy), for buckets up to
`sampling_batch_max`, with the graph machinery of `graphs.py`: one pinned staging buffer
of int64 inputs (ids, the union layout's indices, each row's last fed column) copied in
one transfer, a float64 one for temperatures and uniforms (`_stage_sampling`), the
features copied device to device into a static input. Anything else (wider batches, a
context past the graphs' width) runs `EagerHeadRound`, the same function.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, ViewIndices
from infer.engine.executor.capture import capture_sizes, graph_context_width
from infer.engine.executor.staging import _capture_inputs, _host_indices, _split, _stage_sampling, _Staging, record_graph
from infer.models.eagle import EagleHead
from infer.models.kernels import EAGER, Kernels
from infer.speculative.eagle_round import EagerHeadRound, check_round, head_round


def _round_segments(b: int, w: int, steps: int, s: int) -> list[tuple[str, tuple[int, ...]]]:
    width = w + steps - 1
    return [("ids", (b, w)), ("positions", (b, width)), ("last", (b,)), ("write_rows", (b * width,)),
            ("gather_rows", (b, s)), ("ctx_end", (b,))]


@dataclass
class _HeadGraph:
    graph: torch.cuda.CUDAGraph
    staging: _Staging  # int64 `_round_segments`
    floats: _Staging | None  # float64 [2 + steps, b]: temperature | greedy | uniforms; None when greedy
    features: torch.Tensor  # [b, w, H] static input
    tokens: torch.Tensor  # [b, steps]
    probs: torch.Tensor | None  # [b, steps, V]; None in a greedy round
    # per staging host buffer: its segments, and the union's indices (filled in place)
    host_parts: list[tuple[dict[str, torch.Tensor], ViewIndices]] = field(default_factory=list)


class GraphHeadRound:
    """`HeadRoundFn` by CUDA graph replays (module docstring)."""

    def __init__(self, head: EagleHead, pool: CachePoolProtocol, max_batch_size: int, sampling_batch_max: int,
                 context_width: int | None = None, kernels: Kernels = EAGER) -> None:
        self.head, self.pool, self.kernels = head, pool, kernels
        self.device = next(head.parameters()).device
        self.eager = EagerHeadRound(head, pool, kernels)
        self.context_width = context_width or graph_context_width(pool.max_seq_len)
        self.buckets = [b for b in capture_sizes(max_batch_size) if b <= sampling_batch_max]
        self.graphs: dict[tuple[int, int, int, bool], _HeadGraph] = {}
        self.stream = torch.cuda.Stream(self.device)
        self.replays = 0

    def prepare(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        """Capture every (bucket, feed width, steps, greedy or sampled) round now, at start-up:
        a capture on first use would stall a request."""
        for key in itertools.product(self.buckets, sorted(set(widths)), sorted(set(steps)), (True, False)):
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)

    def __call__(self, ids: torch.Tensor, features: torch.Tensor, layout: BatchLayout, last: Sequence[int],
                 steps: int, temperatures: Sequence[float], uniforms: torch.Tensor,
                 greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_round(ids, layout, last, steps)
        n, w = ids.shape
        if not self.buckets or n > self.buckets[-1] or max(layout.ends) > self.context_width:
            return self.eager(ids, features, layout, last, steps, temperatures, uniforms, greedy)
        key = (next(b for b in self.buckets if b >= n), w, steps, all(greedy))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(*key)
        g.staging.next_host()
        parts, indices = g.host_parts[g.staging.turn]
        self.pool.indices(layout, self.context_width, out=indices)  # padding rows write to scratch
        parts["ids"][:n] = ids
        parts["last"][:n] = torch.tensor(list(last), dtype=torch.long)
        g.staging.send()
        if g.floats is not None:
            _stage_sampling(g.floats, n, temperatures, greedy, uniforms)
            g.floats.send()
        g.features[:n].copy_(features)
        g.graph.replay()
        self.pool.commit(layout)
        self.replays += 1
        return g.tokens[:n], (None if g.probs is None else g.probs[:n])

    @torch.inference_mode()
    def _capture(self, b: int, w: int, steps: int, greedy: bool) -> _HeadGraph:
        s, width = self.context_width, w + steps - 1
        segments = _round_segments(b, w, steps, s)
        device = torch.zeros(sum(torch.Size(shape).numel() for _, shape in segments), dtype=torch.long,
                             device=self.device)
        parts = _split(device, segments)
        _capture_inputs(parts, width, self.pool.scratch_row)
        parts["last"].fill_(w - 1)
        indices = _host_indices(parts)
        dtype = next(self.head.parameters()).dtype
        features = torch.zeros((b, w, self.head.spec.hidden_size), dtype=dtype, device=self.device)
        floats = None
        if not greedy:
            floats = torch.full((2 + steps, b), 0.5, dtype=torch.float64, device=self.device)
            floats[:2] = 1.0  # temperature 1, greedy

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            return head_round(self.head, self.pool.k_cache, self.pool.v_cache, parts["ids"], features, indices,
                              parts["last"], steps, floats, keep_probs=True, kernels=self.kernels)

        graph, (tokens, probs) = record_graph(run, self.stream, self.device)
        g = _HeadGraph(graph, _Staging(device), None if floats is None else _Staging(floats), features, tokens, probs)
        for host in g.staging.hosts:
            host_parts = _split(host, segments)
            g.host_parts.append((host_parts, _host_indices(host_parts)))
        return g


def make_head_round(head: EagleHead, pool: CachePoolProtocol, use_cuda_graphs: bool, max_batch_size: int,
                    sampling_batch_max: int, kernels: Kernels = EAGER) -> GraphHeadRound | EagerHeadRound:
    """The head's round function with its kernel bundle (`step_kernels(config, device, head)`):
    CUDA graphs where asked for and the head is on a CUDA device."""
    if use_cuda_graphs and next(head.parameters()).device.type == "cuda":
        return GraphHeadRound(head, pool, max_batch_size, sampling_batch_max, kernels=kernels)
    return EagerHeadRound(head, pool, kernels)
