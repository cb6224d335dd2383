"""RMSNorm with Hugging Face's numerics: float32 inside, the output in the input's dtype,
then times the weight."""

from __future__ import annotations

import torch
from torch import nn

Tensor = torch.Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., H] -> weight * normalise(x) (float32 inside, output in x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm's weight [H], applied with `rmsnorm`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)
