"""Copies between host and device that do not stall the host.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory makes PyTorch wait until
the GPU has finished everything queued before the copy: in a decode step that is a hidden
synchronisation point, and the host then cannot prepare the next kernels while the GPU
works. Small per-step inputs (uniforms, row indices, per-row parameters) therefore go
through pinned memory with `non_blocking=True`. PyTorch's pinned-memory cache keeps each
staging buffer alive until its copy has run, so the host tensor may be dropped at once.
The other way, `HostCopy` queues a result's copy to pinned memory and waits for it only
when the host reads it, so GPU work queued after it runs on meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; CPU -> CUDA copies are pinned and asynchronous (no host stall)."""
    device = torch.device(device)
    if t.device.type == device.type and (device.index is None or t.device == device):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def tensor_on(data: Sequence | float | int, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """torch.tensor(data, dtype) built on the host and sent to `device` without a stall."""
    return to_device(torch.tensor(data, dtype=dtype), device)


class HostCopy:
    """A device tensor's copy to pinned host memory, queued now and read later (`tolist`):
    the host then waits for the work queued before the copy alone, not for GPU work queued
    after it. `out` (a buffer of at least t's size) and `event` are reused when given (a
    caller alternating two keeps one copy in flight while reading the other); else fresh
    ones. A CPU tensor is read as it is (copied into `out` when given)."""

    def __init__(self, t: torch.Tensor, out: torch.Tensor | None = None,
                 event: torch.cuda.Event | None = None) -> None:
        cuda = t.device.type == "cuda"
        if out is not None:
            out = out[:t.numel()].view(t.shape)
        elif cuda:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host = t if out is None else out
        if out is not None:
            out.copy_(t, non_blocking=cuda)
        self.event = None if not cuda else event if event is not None else torch.cuda.Event()
        if self.event is not None:
            self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
