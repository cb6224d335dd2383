"""Launch parameters of the Triton matmul (`triton_linear.py`) per shape, and its split-K
workspace. Pure Python: the CPU never launches the kernel, but layers own a workspace.

The choice follows measurements on an H200 (docs/benchmarks.md, `scripts/bench_matmul.py`):
small batches (M <= 16 rows) read each weight once, so the tile is 16 rows by `block_n`
columns streaming K; where the output has too few column tiles to give every
multiprocessor several programs, K is split. Larger M (prefill of FP8 weights) takes
64-row tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALL_M = 16  # rows up to which decode-style tiles are used
NUM_SMS = 132  # H100 / H200 multiprocessors: the split-K heuristic's target
_MIN_PROGRAMS = 512  # column tiles x splits below which K is split further


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Tile sizes and launch parameters of one matmul call."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("split_k, num_warps and num_stages must be >= 1")


def choose_config(m: int, n: int, k: int, fp8: bool = True) -> LinearConfig:
    """Tiles for y[m, n] = x[m, k] W^T (FP8 W: the configuration measured best in CUDA
    graphs on an H200 for Llama 3.2 1B/3B shapes, `scripts/bench_matmul.py --sweep`)."""
    if m > SMALL_M:
        return LinearConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    block_n, block_k = 32, 128
    tiles = -(-n // block_n)
    k_tiles = -(-k // block_k)
    split = 1
    while tiles * split < _MIN_PROGRAMS and split * 2 <= k_tiles // 2:
        split *= 2
    return LinearConfig(block_m=16, block_n=block_n, block_k=block_k, split_k=split, num_warps=4, num_stages=4)


class SplitWorkspace:
    """Partial sums and per-tile counters of one layer's split-K launches (device memory kept
    for the layer's life: the launches replay inside CUDA graphs)."""

    def __init__(self) -> None:
        self.partials: torch.Tensor | None = None  # float32, flat
        self.counters: torch.Tensor | None = None  # int32, flat, zero between launches

    def get(self, partial_elems: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials is None or self.partials.numel() < partial_elems or self.partials.device != device:
            self.partials = torch.empty(partial_elems, dtype=torch.float32, device=device)
        if self.counters is None or self.counters.numel() < tiles or self.counters.device != device:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        return self.partials, self.counters
