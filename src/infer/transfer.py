"""Copies between host and device that do not stall the host.

A copy from pageable host memory waits for all queued GPU work, so small per-step inputs go
through pinned memory with `non_blocking=True` (PyTorch keeps the staging buffer alive until
the copy runs). `HostCopy` queues a result's copy to pinned memory and waits only when read.
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
    """A device tensor's copy to pinned host memory, queued now and read later (`tolist`, which
    waits for the work before the copy alone). `out` (at least t's size) and `event` are reused
    when given. A CPU tensor is read as it is (copied into `out` when given)."""

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
