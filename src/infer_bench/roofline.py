"""Memory-bandwidth roofline for decode, measured in the same process as the run.

At batch 1 a decode step reads every weight once (tied embeddings once), so it cannot beat
weight bytes / memory bandwidth; at batch B it also reads every row's K and V. The bandwidth
comes from a copy probe: the median of several copies on a GPU, on a CPU the best copy on one
thread and on every core (why: docs/benchmarks.md, "Method").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from infer.engine.threads import available_cores
from infer.timing import synchronize

GPU_PROBE_BYTES = 1 << 30  # 1 GiB source, 1 GiB destination
CPU_PROBE_BYTES = 1 << 25


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # GPU: the samples' median; CPU: their best; bytes read + bytes written
    probe_bytes: int  # size of the copied tensor
    samples: list[float]  # bytes/s of each timed copy
    device: str

    def to_dict(self) -> dict[str, object]:
        return {"bytes_per_s": self.bytes_per_s, "gb_per_s": self.bytes_per_s / 1e9,
                "probe_bytes": self.probe_bytes, "samples_gb_per_s": [s / 1e9 for s in self.samples],
                "device": self.device}


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 10,
                   warmup: int = 3) -> Bandwidth:
    """Device-to-device copy bandwidth: (read + write bytes) / time; the median of `repeats`
    copies on a GPU, the best of `repeats` on one thread and `repeats` on every core on a CPU."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = GPU_PROBE_BYTES if device.type == "cuda" else CPU_PROBE_BYTES
    if nbytes < 1024 or repeats < 1:
        raise ValueError(f"copy_bandwidth needs nbytes >= 1024 and repeats >= 1, got {nbytes}, {repeats}")
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)  # [n]
    dst = torch.empty_like(src)  # [n]
    for _ in range(warmup):
        dst.copy_(src)
    if device.type == "cuda":
        seconds = _timed_copies(src, dst, repeats)
    else:
        seconds = []
        threads = torch.get_num_threads()
        try:
            for count in sorted({1, available_cores()}):
                torch.set_num_threads(count)
                seconds += _timed_copies(src, dst, repeats)
        finally:
            torch.set_num_threads(threads)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    moved = 2 * n * 4
    samples = [moved / s for s in seconds]
    best = statistics.median(samples) if device.type == "cuda" else max(samples)
    return Bandwidth(best, n * 4, samples, str(device))


def _timed_copies(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> list[float]:
    if src.device.type == "cuda":
        out = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out
    out = []
    for _ in range(repeats):
        synchronize(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    return out


@dataclass(frozen=True)
class Roofline:
    weight_bytes: int
    bandwidth_bytes_per_s: float
    step_s: float  # the fastest possible batch-1 decode step
    tokens_per_s: float  # 1 / step_s

    def to_dict(self) -> dict[str, float]:
        return {"weight_bytes": self.weight_bytes, "weight_gb": self.weight_bytes / 1e9,
                "bandwidth_gb_per_s": self.bandwidth_bytes_per_s / 1e9, "step_ms": self.step_s * 1e3,
                "tokens_per_s": self.tokens_per_s}


def decode_roofline(weight_bytes_: int, bandwidth_bytes_per_s: float) -> Roofline:
    """Batch-1 decode roofline: step time = weight bytes / bandwidth."""
    if weight_bytes_ <= 0 or bandwidth_bytes_per_s <= 0:
        raise ValueError(f"weight bytes and bandwidth must be > 0, got {weight_bytes_}, {bandwidth_bytes_per_s}")
    step = weight_bytes_ / bandwidth_bytes_per_s
    return Roofline(weight_bytes_, bandwidth_bytes_per_s, step, 1.0 / step)


def decode_step_bytes(weight_bytes_: int, kv_bytes_per_token_: int, batch: int, context: float) -> int:
    """Bytes a decode step of `batch` rows reads at least: every weight once, and each row's
    cached K and V of `context` tokens (its mean over the rows)."""
    if weight_bytes_ <= 0 or kv_bytes_per_token_ < 0 or batch < 1 or context < 0:
        raise ValueError(f"decode_step_bytes needs weights > 0, KV bytes >= 0, batch >= 1 and context >= 0, got "
                         f"{weight_bytes_}, {kv_bytes_per_token_}, {batch}, {context}")
    return weight_bytes_ + round(batch * context * kv_bytes_per_token_)
