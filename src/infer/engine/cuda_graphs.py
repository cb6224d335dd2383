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
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, ... up to and including max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


STAGING_BUFFERS = 4  # pinned staging buffers per graph, used in turn


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hosts: list[torch.Tensor]  # pinned int64 staging buffers, same layout as `device`, used in turn
    copied: list[torch.cuda.Event | None]  # per buffer: recorded after its last copy was queued
    device: torch.Tensor  # int64: ids | positions | last | write_rows | gather_rows | ctx_end
    ids: torch.Tensor  # [b, w]   (views into `device`)
    positions: torch.Tensor  # [b, w] (also the view's q_pos)
    last: torch.Tensor  # [b] logits index per row (last-token mode)
    indices: ViewIndices  # write [b*w], gather [b, S], q_pos [b, w], ctx_end [b]
    out: torch.Tensor  # [b, w, V] or [b, V]


def _segments(b: int, w: int, s: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("ids", (b, w)), ("positions", (b, w)), ("last", (b,)), ("write_rows", (b * w,)),
            ("gather_rows", (b, s)), ("ctx_end", (b,))]


def _split(buf: torch.Tensor, b: int, w: int, s: int) -> dict[str, torch.Tensor]:
    parts, offset = {}, 0
    for name, shape in _segments(b, w, s):
        n = 1
        for x in shape:
            n *= x
        parts[name] = buf[offset:offset + n].view(shape)
        offset += n
    return parts


class GraphForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, batch_sizes: Iterable[int],
                 shapes: Iterable[tuple[int, bool]], context_width: int | None = None,
                 kernels: Kernels = EAGER) -> None:
        """shapes: (width, all_logits) pairs to capture for every batch bucket."""
        self.model, self.pool, self.kernels = model, pool, kernels
        self.device = next(model.parameters()).device
        self.eager = EagerForward(model, pool, kernels)
        self.context_width = context_width or pool.max_seq_len
        self.buckets = sorted(set(batch_sizes))
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        stream = torch.cuda.Stream(self.device)
        for b in self.buckets:
            for w, all_logits in sorted(set(shapes)):
                self.graphs[(b, w, all_logits)] = self._capture(b, w, all_logits, stream)
        self.replays = 0

    @torch.inference_mode()
    def _capture(self, b: int, w: int, all_logits: bool, stream: torch.cuda.Stream) -> _Graph:
        s = self.context_width
        size = sum(torch.Size(shape).numel() for _, shape in _segments(b, w, s))
        hosts = [torch.zeros(size, dtype=torch.long).pin_memory() for _ in range(STAGING_BUFFERS)]
        device = torch.zeros(size, dtype=torch.long, device=self.device)
        parts = _split(device, b, w, s)
        parts["positions"].copy_(torch.arange(w).repeat(b, 1))
        parts["last"].fill_(w - 1)
        parts["write_rows"].fill_(self.pool.scratch_row)
        parts["gather_rows"].fill_(self.pool.scratch_row)
        parts["ctx_end"].fill_(w)
        ids, positions, last = parts["ids"], parts["positions"], parts["last"]
        indices = ViewIndices(parts["write_rows"], parts["gather_rows"], positions, parts["ctx_end"])
        view = CacheView(self.pool.k_cache, self.pool.v_cache, indices)

        def run() -> torch.Tensor:
            return self.model(ids, positions, view, logits_indices=None if all_logits else last,
                              kernels=self.kernels)

        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = run()
        for host in hosts:
            host.copy_(device.cpu())
        return _Graph(graph, hosts, [None] * STAGING_BUFFERS, device, ids, positions, last, indices, out)

    def supports(self, layout: BatchLayout, all_logits: bool) -> bool:
        return (len(layout.slots) <= self.buckets[-1] and max(layout.ends) <= self.context_width
                and (self.buckets[0], layout.width, all_logits) in self.graphs)

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        if not self.supports(layout, all_logits):
            return self.eager(ids, layout, all_logits)
        n = len(layout.slots)
        b = next(x for x in self.buckets if x >= n)
        g = self.graphs[(b, layout.width, all_logits)]
        idx = self.pool.indices(layout, self.context_width)
        # steps queued back to back (the draft loop does not wait for the GPU): a staging
        # buffer is rewritten only once the copy that last read it has run
        turn = self.replays % STAGING_BUFFERS
        if g.copied[turn] is not None:
            g.copied[turn].synchronize()
        host = g.hosts[turn]
        staged = _split(host, b, layout.width, self.context_width)
        if not ids.is_cuda:
            staged["ids"][:n] = ids
        staged["positions"][:n] = idx.q_pos
        staged["last"][:n] = layout.last_token_indices("cpu")
        staged["write_rows"].fill_(self.pool.scratch_row)  # padding rows write to scratch
        staged["write_rows"][: n * layout.width] = idx.write_rows
        staged["gather_rows"][:n] = idx.gather_rows
        staged["ctx_end"][:n] = idx.ctx_end
        g.device.copy_(host, non_blocking=True)  # one transfer for all inputs
        if g.copied[turn] is None:
            g.copied[turn] = torch.cuda.Event()
        g.copied[turn].record()
        if ids.is_cuda:  # tokens produced on the device by the previous step
            g.ids[:n].copy_(ids)
        g.graph.replay()
        self.pool.commit(layout)
        self.replays += 1
        return g.out[:n]
