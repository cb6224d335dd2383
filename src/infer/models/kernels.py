"""Elementwise kernels of the decoder, as a swappable bundle.

`EAGER` is the reference: plain PyTorch with Hugging Face's numerics (RMSNorm in float32,
residual adds in the activation dtype). `compiled_kernels()` returns the same functions
fused by `torch.compile` (one Triton kernel each instead of 5-10 small launches), which is
where a memory-bound decode step loses most of its time on a GPU. The model receives the
bundle explicitly; nothing global is patched.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., H] -> weight * normalise(x) (float32 inside, output in x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add fused with the next norm."""
    total = x + residual
    return rmsnorm(total, weight, eps), total


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE; x: [B, T, H, D], cos/sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU activation of a fused [..., 2 * I] gate/up projection -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]
    add_rmsnorm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotary_qk: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_mul: Callable[[Tensor], Tensor]
    name: str = "eager"


EAGER = Kernels(rmsnorm, add_rmsnorm, rotary_qk, silu_mul)


_COMPILED: dict[Hashable, Kernels] = {}


def compiled_kernels(key: Hashable = None) -> Kernels:
    """The same functions through torch.compile (dynamic shapes), one bundle per `key`.

    torch.compile keeps its compiled variants on the function's code object, with a limit
    per code object (then it silently falls back to eager). Engines for several models in
    one process (a benchmark run, a target and its draft) would share, and exhaust, that
    limit; so each key (a model's shape signature, as `engine.runner.step_kernels` builds it)
    gets fresh code objects, and engines of the same model reuse one bundle.
    """
    if key in _COMPILED:
        return _COMPILED[key]

    def comp(fn: Callable) -> Callable:
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                   fn.__closure__)
        # fullgraph=False: past the recompile limit a new shape runs eagerly instead of failing
        return torch.compile(fresh, dynamic=True, fullgraph=False)

    kernels = Kernels(comp(rmsnorm), comp(add_rmsnorm), comp(rotary_qk), comp(silu_mul), name="compiled")
    _COMPILED[key] = kernels
    return kernels
