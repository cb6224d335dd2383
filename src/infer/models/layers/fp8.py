"""FP8 weight quantization: per-output-channel symmetric E4M3.

A row w of W is stored as round_e4m3(w / s), s = max |w| / 448 (the largest E4M3 value). An
element's error is at most half an E4M3 step: a relative 2^-4 (3 mantissa bits), plus s * 2^-9
near zero (the subnormal step).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def quantize_fp8_rows(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (float) -> (E4M3 [N, K], scale float32 [N]), per row; `absmax` [N]: each row's
    max |w| when wider than `weight` (a tensor-parallel shard's columns), default the rows' own."""
    w = weight.to(torch.float32)
    peak = w.abs().amax(dim=1) if absmax is None else absmax.to(torch.float32)
    scale = (peak / FP8_MAX).clamp(min=_MIN_SCALE)  # [N]
    quantized = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [N, K]
    return quantized, scale


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [N, K] and scale [N] -> [N, K] in `dtype` (computed in float32)."""
    return (quantized.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
