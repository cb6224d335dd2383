"""Timing helpers: device synchronisation and the median of repeated calls, each bracketed
by synchronisations (so it includes the host work an engine step pays)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class TimingStats:
    median_s: float
    min_s: float
    max_s: float
    samples: int

    def to_dict(self) -> dict[str, float]:
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s, "samples": self.samples}


def summarize(samples: list[float]) -> TimingStats:
    if not samples:
        raise ValueError("summarize needs at least one timing sample")
    return TimingStats(statistics.median(samples), min(samples), max(samples), len(samples))


def time_calls(fn: Callable[[], object], device: torch.device | str, repeats: int = 20,
               warmup: int = 3) -> TimingStats:
    """Median wall time of `fn()` over `repeats` synchronised calls, after `warmup` calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return summarize(samples)
