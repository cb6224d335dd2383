"""CUDA graphs for the fixed-shape steps: decode, draft steps, speculative verification.

A `GraphForward` captures `model(ids, positions, CacheView(static indices))` once per
(batch bucket, width, logits mode) with persistent input tensors. A step pads its batch to
the next captured bucket (padding rows write to the pool's scratch row and are masked),
copies ids, positions and cache indices into the persistent tensors and replays. The
context width S is fixed at max_seq_len so every step of a bucket has the same shapes.
Anything that does not fit (wider chunks, prefill) runs eagerly through the same model.
Replay computes the same function as eager; tests/gpu checks the tokens are identical.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, CacheView, ViewIndices
from infer.cache.forward import EagerForward
from infer.models.llama import LlamaForCausalLM


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, ... up to and including max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [b, w]
    positions: torch.Tensor  # [b, w]
    indices: ViewIndices  # write [b*w], gather [b, S], mask [b, w, S]
    last: torch.Tensor  # [b] logits index per row (last-token mode)
    out: torch.Tensor  # [b, w, V] or [b, V]


class GraphForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, batch_sizes: Iterable[int],
                 widths: Iterable[int], modes: Iterable[bool] = (False,), context_width: int | None = None) -> None:
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.eager = EagerForward(model, pool)
        self.context_width = context_width or pool.max_seq_len
        self.buckets = sorted(set(batch_sizes))
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        stream = torch.cuda.Stream(self.device)
        for b in self.buckets:
            for w in sorted(set(widths)):
                for all_logits in modes:
                    self.graphs[(b, w, all_logits)] = self._capture(b, w, all_logits, stream)
        self.replays = 0

    def _static_indices(self, b: int, w: int) -> ViewIndices:
        s, scratch = self.context_width, self.pool.scratch_row
        mask = torch.zeros((b, w, s), dtype=torch.bool, device=self.device)
        mask[..., 0] = True
        return ViewIndices(torch.full((b * w,), scratch, dtype=torch.long, device=self.device),
                           torch.full((b, s), scratch, dtype=torch.long, device=self.device), mask)

    @torch.inference_mode()
    def _capture(self, b: int, w: int, all_logits: bool, stream: torch.cuda.Stream) -> _Graph:
        ids = torch.zeros((b, w), dtype=torch.long, device=self.device)
        positions = torch.arange(w, device=self.device).repeat(b, 1)
        indices = self._static_indices(b, w)
        last = torch.full((b,), w - 1, dtype=torch.long, device=self.device)
        view = CacheView(self.pool.k_cache, self.pool.v_cache, indices)

        def run() -> torch.Tensor:
            return self.model(ids, positions, view, logits_indices=None if all_logits else last)

        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run()
        return _Graph(graph, ids, positions, indices, last, out)

    def supports(self, layout: BatchLayout, all_logits: bool) -> bool:
        return (len(layout.slots) <= self.buckets[-1] and max(layout.ends) <= self.context_width
                and any((b, layout.width, all_logits) in self.graphs for b in self.buckets))

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        if not self.supports(layout, all_logits):
            return self.eager(ids, layout, all_logits)
        n = len(layout.slots)
        b = next(x for x in self.buckets if x >= n)
        g = self.graphs[(b, layout.width, all_logits)]
        host = self.pool.indices(layout, self.context_width)
        g.indices.write_rows.fill_(self.pool.scratch_row)
        g.indices.write_rows[: n * layout.width].copy_(host.write_rows, non_blocking=True)
        g.indices.gather_rows[:n].copy_(host.gather_rows, non_blocking=True)
        g.indices.mask[:n].copy_(host.mask, non_blocking=True)
        g.ids[:n].copy_(ids, non_blocking=True)
        g.positions[:n].copy_(layout.positions("cpu"), non_blocking=True)
        g.last[:n].copy_(layout.last_token_indices("cpu"), non_blocking=True)
        g.graph.replay()
        self.pool.commit(layout)
        self.replays += 1
        return g.out[:n]
