"""CPU threads for torch's kernels: `EngineConfig.threads`, or one per 250M parameters, at
most half the cores this process may use, at least one (docs/benchmarks.md, "Host-side costs").
"""

from __future__ import annotations

import os
import sys

import torch

PARAMS_PER_THREAD = 250_000_000


def available_cores() -> int:
    if sys.platform == "linux":  # the cores this process may run on (containers, taskset)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_threads(num_parameters: int, cores: int) -> int:
    """Threads for a model of `num_parameters` on `cores` cores."""
    return max(1, min(cores // 2, num_parameters // PARAMS_PER_THREAD))


def apply_cpu_threads(requested: int | None, device: torch.device, num_parameters: int) -> int | None:
    """Set torch's intra-op threads for a CPU engine (None for other devices); returns the count."""
    if device.type != "cpu":
        return None
    threads = requested if requested is not None else auto_threads(num_parameters, available_cores())
    torch.set_num_threads(threads)
    return threads
