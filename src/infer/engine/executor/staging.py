"""CUDA graph capture (`record_graph`) and the staging of a replay's inputs: pinned host buffers
that feed a graph's static inputs, and the layout of those inputs (one int64 buffer split into
named segments), so a replay's inputs reach the GPU in one transfer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from infer.cache.view import ViewIndices

STAGING_BUFFERS = 4  # pinned staging buffers per graph, used in turn
T = TypeVar("T")


def record_graph(run: Callable[[], T], stream: torch.cuda.Stream, device: torch.device,
                 pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm `run` up on the side stream, then capture it: (graph, run's outputs). `pool`: a
    memory pool shared with other graphs (`torch.cuda.graph_pool_handle()`), for graphs of
    which only one runs at a time."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        out = run()
    return graph, out




class _Staging:
    """A ring of pinned host buffers feeding one device buffer. Steps are queued back to back
    (the draft loop does not wait for the GPU), so a host buffer is rewritten only once the
    copy that last read it has run."""

    def __init__(self, device_buf: torch.Tensor) -> None:
        self.device = device_buf
        self.hosts = [torch.zeros_like(device_buf, device="cpu").pin_memory() for _ in range(STAGING_BUFFERS)]
        for host in self.hosts:
            host.copy_(device_buf.cpu())
        self.copied: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self.turn = 0
        # the device with its index: `current_stream(index)` is one call into torch, while
        # `Event.record()` without a stream finds the current device through Python layers
        # (an availability check reading the environment), several us a copy on a GPU host
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


def _stage_sampling(staging: _Staging, n: int, temperatures: Sequence[float], greedy: Sequence[bool],
                    uniforms: torch.Tensor) -> None:
    """Fill the next host buffer of a float64 [2 + U, b] staging ring (temperature | greedy |
    U uniforms per row) for the first n rows; uniforms: CPU [n, U]. The copy is queued by
    `send`."""
    floats = staging.next_host()
    floats[0, :n] = torch.tensor(list(temperatures), dtype=torch.float64)
    floats[1, :n] = torch.tensor(list(greedy), dtype=torch.float64)
    floats[2:, :n] = uniforms.t()


def _host_indices(parts: dict[str, torch.Tensor]) -> ViewIndices:
    """The index segments of a buffer's parts (`_split`; staged host or device) as ViewIndices."""
    return ViewIndices(parts["write_rows"], parts["gather_rows"], parts["positions"], parts["ctx_end"])


def _capture_inputs(parts: dict[str, torch.Tensor], width: int, scratch_row: int) -> None:
    """Inputs a graph is captured with: positions 0..width-1 per row, every row written to
    and gathered from the scratch row, contexts `width` long (harmless wherever they run)."""
    parts["positions"].copy_(torch.arange(width).repeat(parts["positions"].shape[0], 1))
    parts["write_rows"].fill_(scratch_row)
    parts["gather_rows"].fill_(scratch_row)
    parts["ctx_end"].fill_(width)


def _split(buf: torch.Tensor, segments: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Views of `buf` for the named segments, in order."""
    parts, offset = {}, 0
    for name, shape in segments:
        n = 1
        for x in shape:
            n *= x
        parts[name] = buf[offset:offset + n].view(shape)
        offset += n
    return parts
