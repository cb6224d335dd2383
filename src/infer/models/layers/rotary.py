"""Rotary position embedding (rotate-half, Hugging Face's numerics): inverse frequencies with
Llama 3 scaling, cos / sin tables of explicit positions, and the rotation of q and k heads."""

from __future__ import annotations

import math

import torch
from torch import nn

from infer.models.config import ModelConfig, RopeScaling

Tensor = torch.Tensor


def cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions: [B, T] -> cos, sin: [B, T, 1, D] (float32 inside, then `dtype`, as HF)."""
    freqs = positions.float()[..., None] * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE; x: [B, T, H, D], cos/sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [B, T, Hq, D], k: [B, T, Hkv, D] -> both rotated (cos/sin: [B, T, 1, D])."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  freq_factors: tuple[float, ...] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] on the CPU (even under a meta default device), with Llama 3
    scaling as parameters (`scaling`) or llama.cpp's per-frequency divisors (`freq_factors`)."""
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
