"""Rotary position embedding's math (rotate-half convention, Hugging Face's numerics): the
cos / sin tables of explicit positions and the rotation of query and key heads. Pure
functions, shared by the kernel bundles (models/kernels.py) and the attention views that
rotate as they write their cache (models/attention.py, models/paged_attention.py)."""

from __future__ import annotations

import torch

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
