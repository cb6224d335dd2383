"""CUDA graph capture (`record_graph`) and the staging of a replay's inputs: pinned host buffers
that feed a graph's static inputs in one transfer. `PlanInputs`: a graph's flat batch, padded."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from infer.cache.forward_batch import ARRAYS, BatchPlan, batch_of
from infer.models.batch import ForwardBatch

STAGING_BUFFERS = 4  # pinned staging buffers per graph, used in turn
T = TypeVar("T")


def record_graph(run: Callable[[], T], stream: torch.cuda.Stream, device: torch.device,
                 pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm `run` up on the side stream, then capture it: (graph, run's outputs). `pool`: a
    memory pool shared with graphs of which only one runs at a time."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        out = run()
    return graph, out


class Staging:
    """A ring of pinned host buffers feeding one device buffer; a host buffer is rewritten only
    once the copy that last read it has run."""

    def __init__(self, device_buf: torch.Tensor) -> None:
        self.device = device_buf
        self.hosts = [torch.zeros_like(device_buf, device="cpu").pin_memory() for _ in range(STAGING_BUFFERS)]
        for host in self.hosts:
            host.copy_(device_buf.cpu())
        self.copied: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self.turn = 0
        # (`current_stream(index)` is cheaper than `Event.record()` finding the current device)
        self.device_index = device_buf.device.index

    def next_host(self) -> torch.Tensor:
        self.turn = (self.turn + 1) % STAGING_BUFFERS
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.hosts[self.turn]

    def send(self) -> None:
        """Queue the copy of the current host buffer (one transfer for all inputs)."""
        self.device.copy_(self.hosts[self.turn], non_blocking=True)
        if self.copied[self.turn] is None:
            self.copied[self.turn] = torch.cuda.Event()
        self.copied[self.turn].record(torch.cuda.current_stream(self.device_index))


def stage_sampling(staging: Staging, n: int, temperatures: Sequence[float], greedy: Sequence[bool],
                    uniforms: torch.Tensor) -> None:
    """Fill the next host buffer of a float64 [2 + U, b] staging ring (temperature | greedy |
    U uniforms per row) for the first n rows; uniforms: CPU [n, U]."""
    floats = staging.next_host()
    floats[0, :n] = torch.tensor(list(temperatures), dtype=torch.float64)
    floats[1, :n] = torch.tensor(list(greedy), dtype=torch.float64)
    floats[2:, :n] = uniforms.t()


def plan_sizes(tokens: int, rows: int) -> list[int]:
    """Entries of each of the ARRAYS in a graph of `tokens` tokens over `rows` rows."""
    per_row = {"row_slots": rows, "seq_lens": rows, "query_start": rows + 1}
    return [per_row.get(name, tokens) for name in ARRAYS]


def stage(parts: Mapping[str, np.ndarray], plan: BatchPlan) -> None:
    """Fill a staging buffer's ARRAYS (numpy host views: cheaper than torch slices) with the
    plan's, padding the rest (padding tokens: position -1, row 0; padding rows: no context)."""
    for name in ARRAYS:
        src, dst = plan.arrays[name], parts[name]
        n = src.shape[0]
        dst[:n] = src
        dst[n:] = -1 if name == "positions" else 0


class PlanInputs:
    """A graph's flat batch: the ARRAYS of `tokens` tokens over `rows` rows in one device buffer
    fed from a `Staging` ring; `batch` builds the ForwardBatch inside the captured function."""

    def __init__(self, tokens: int, rows: int, device: torch.device) -> None:
        self.tokens, self.rows = tokens, rows
        sizes = plan_sizes(tokens, rows)
        buf = torch.zeros(sum(sizes), dtype=torch.long, device=device)  # int64 [6 N + 2 R + (R + 1) + N]
        self.parts = dict(zip(ARRAYS, torch.split(buf, sizes), strict=True))
        self.parts["positions"].fill_(-1)  # (capture inputs: every token padding)
        self.staging = Staging(buf)
        self.host_arrays = [dict(zip(ARRAYS, np.split(host.numpy(), np.cumsum(sizes)[:-1]), strict=True))
                            for host in self.staging.hosts]

    @property
    def ids(self) -> torch.Tensor:
        """[tokens] the device ids (ids already on the device are copied in here)."""
        return self.parts["ids"]

    def stage(self, plan: BatchPlan) -> None:
        """Queue the plan's arrays (padded) to the device buffer: one transfer."""
        self.staging.next_host()
        stage(self.host_arrays[self.staging.turn], plan)
        self.staging.send()

    def batch(self, tables: torch.Tensor, block_size: int, scratch_row: int, context_width: int,
              tree_width: int) -> ForwardBatch:
        """The ForwardBatch of the staged arrays (`tables`: the pool's device tables [slots,
        max_blocks], read in place at every replay)."""
        return batch_of(self.parts, tables, block_size, scratch_row, (1,) * self.tokens, context_width, tree_width)
