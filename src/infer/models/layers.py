"""Llama building blocks: RMSNorm, rotary tables (with Llama 3 scaling), SwiGLU MLP.

Numerics follow Hugging Face's Llama: RMSNorm in float32 then cast back, rotary tables
computed in float32 and cast to the activation dtype, rotate-half convention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from infer.models.config import ModelConfig, RopeScaling
from infer.models.kernels import rmsnorm
from infer.models.linear import make_linear
from infer.models.parallel import REPLICATED, Parallel


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] on the CPU (also under a meta default device: its
    ops would import torch's Python decompositions), with Llama 3 scaling when given: as
    parameters (`scaling`) or as llama.cpp's per-frequency divisors (`freq_factors`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if freq_factors is not None:
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu")
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotary position embedding for explicit per-token positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                            config.rope_freq_factors)
        self.register_buffer("inv_freq", inv, persistent=False)


class MLP(nn.Module):
    """SwiGLU's weights: gate and up projections fused into one matrix, then down. The decoder
    layer applies them through its kernel bundle (`Kernels.mlp`). Under tensor parallelism
    gate/up are `column`-parallel and down `row`-parallel (config: the rank's shape)."""

    def __init__(self, config: ModelConfig, quantization: str | None = None, column: Parallel = REPLICATED,
                 row: Parallel = REPLICATED) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size, quantization, column)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, quantization, row)
