"""Launch parameters of the Triton matmul (`matmul.py`) per shape, and its split-K workspace.
Pure Python: the CPU never launches the kernel, but layers own a workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALL_M = 16  # rows up to which decode-style tiles are used


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


def choose_config(m: int, n: int, k: int) -> LinearConfig:
    """Tiles for y[m, n] = x[m, k] W^T, W in FP8 (from `scripts/bench_matmul.py --sweep`): up to
    SMALL_M rows, 16-row tiles with K split for narrow outputs; more rows, 64-row tiles."""
    if m > SMALL_M:
        return LinearConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    tiles = -(-n // 64)
    if tiles >= 128:
        return LinearConfig(block_m=16, block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=4)
    k_tiles = -(-k // 128)
    split = 8 if k_tiles >= 32 else 4 if k_tiles >= 8 else 1
    return LinearConfig(block_m=16, block_n=64, block_k=128, split_k=split, num_warps=4, num_stages=4)


class SplitWorkspace:
    """Partial sums and per-tile counters of a layer's split-K launches, kept for CUDA-graph replays."""

    def __init__(self) -> None:
        self.partials: torch.Tensor | None = None  # float32, flat
        self.counters: torch.Tensor | None = None  # int32, flat, zero between launches
        self.gemv_counters: torch.Tensor | None = None  # int32 [N]: the GEMV's, one a row block

    def get(self, partial_elems: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials is None or self.partials.numel() < partial_elems or self.partials.device != device:
            self.partials = torch.empty(partial_elems, dtype=torch.float32, device=device)
        if self.counters is None or self.counters.numel() < tiles or self.counters.device != device:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        return self.partials, self.counters

    def row_counters(self, n: int, device: torch.device) -> torch.Tensor:
        """The GEMV's split-K counters for a matrix of N rows: N of them (more than any tile has
        row blocks), allocated once, so CUDA graphs captured at any row count keep using them."""
        if self.gemv_counters is None or self.gemv_counters.numel() < n or self.gemv_counters.device != device:
            self.gemv_counters = torch.zeros(n, dtype=torch.int32, device=device)
        return self.gemv_counters
