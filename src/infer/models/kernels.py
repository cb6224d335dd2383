"""The decoder's kernels, as a swappable bundle.

`EAGER` is the reference: plain PyTorch with Hugging Face's numerics (RMSNorm in float32,
residual adds in the activation dtype, a projection then its SwiGLU or residual add).
`compiled_kernels()` returns the same functions fused: the elementwise ones by
`torch.compile` (one Triton kernel each instead of 5-10 small launches), and small-batch
FP8 projections on the GPU by the Triton matmul (models/triton_linear.py), which applies
the scales and does the SwiGLU or the residual add in its epilogue, and one-row projections by
the few-row GEMV (models/triton_gemv.py). A memory-bound decode step loses most of its time
to launches and slow small matmuls otherwise. The model receives the bundle explicitly;
nothing global is patched.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from infer.models.linear_tiles import SMALL_M, choose_config

if TYPE_CHECKING:
    from infer.models.linear import LinearBase

Tensor = torch.Tensor


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., H] -> weight * normalise(x) (float32 inside, output in x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def linear(layer: LinearBase, x: Tensor, residual: Tensor | None) -> Tensor:
    """layer(x) [..., N], plus `residual` [..., N] when given (the residual stream's add)."""
    y = layer(x)
    return y if residual is None else residual + y


def swiglu(layer: LinearBase, x: Tensor) -> Tensor:
    """silu(gate) * up of a fused gate/up projection: [..., K] -> [..., I]."""
    return silu_mul(layer(x))


def _triton_ready(layer: LinearBase, x: Tensor) -> bool:
    """Whether the Triton matmul serves this call: an FP8 layer (dense ones measure faster
    on cuBLAS) without a bias, with a CUDA half-precision input of at most SMALL_M rows
    (decode, draft steps, verification): its epilogue then does the SwiGLU or the residual
    add too."""
    return (layer.matrix()[1] is not None and layer.bias is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() <= SMALL_M * x.shape[-1])


def _triton(layer: LinearBase, x: Tensor, residual: Tensor | None, swiglu_: bool) -> Tensor:
    """The Triton matmul with the residual add (or SwiGLU) in its epilogue; a layer whose
    matmul is a partial sum (row-parallel) adds the residual after `combine` instead."""
    from infer.models.triton_linear import triton_linear
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    weight, scale = layer.matrix()
    n = weight.shape[0] // 2 if swiglu_ else weight.shape[0]
    fuse_add = residual is not None and not layer.partial_output
    res = residual.reshape(-1, n).contiguous() if fuse_add and residual is not None else None
    y = triton_linear(rows, weight, scale, choose_config(rows.shape[0], n, rows.shape[1]),
                      layer.workspace, res, swiglu_)
    y = layer.combine(y.view(*x.shape[:-1], n))
    return y if residual is None or fuse_add else residual + y


def _gemv_ready(layer: LinearBase, x: Tensor) -> bool:
    """Whether the few-row GEMV (models/triton_gemv.py) serves this call: one row (batch-1
    decode, a draft step) of a CUDA half-precision input, a layer without a bias. At one row
    it reads the weight faster than cuBLAS and the Triton matmul on an H200
    (scripts/bench_gemv.py); at two rows and more it does not."""
    return (layer.bias is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() == x.shape[-1])


def _gemv(layer: LinearBase, x: Tensor, residual: Tensor | None) -> Tensor:
    """The GEMV with the residual add in its epilogue (after `combine` for a row-parallel
    layer, whose matmul is a partial sum)."""
    from infer.models.triton_gemv import gemv
    weight, scale = layer.matrix()
    fuse_add = residual is not None and not layer.partial_output
    n = weight.shape[0]
    y = gemv(x.reshape(1, -1), weight, scale, residual=residual.reshape(1, n) if fuse_add else None)
    y = layer.combine(y.view(*x.shape[:-1], n))
    return y if residual is None or fuse_add else residual + y


def add(x: Tensor, y: Tensor) -> Tensor:
    return x + y


class FusedLinear:
    """The fused bundle's `linear` and `swiglu`. One row: the GEMV (`linear` with the add in
    its epilogue; a dense gate/up then `silu_mul`). More rows, and an FP8 gate/up: FP8 layers
    through the Triton matmul with the add or the activation in its epilogue; dense layers
    through cuBLAS, then one fused elementwise kernel (`add`, `silu_mul` compiled)."""

    def __init__(self, compiled_add: Callable[[Tensor, Tensor], Tensor],
                 compiled_silu_mul: Callable[[Tensor], Tensor]) -> None:
        self.add, self.silu_mul = compiled_add, compiled_silu_mul

    def linear(self, layer: LinearBase, x: Tensor, residual: Tensor | None) -> Tensor:
        if _gemv_ready(layer, x):
            return _gemv(layer, x, residual)
        if _triton_ready(layer, x):
            return _triton(layer, x, residual, False)
        y = layer(x)
        return y if residual is None else self.add(residual, y)

    def swiglu(self, layer: LinearBase, x: Tensor) -> Tensor:
        if _triton_ready(layer, x):  # (FP8 gate/up: the matmul's SwiGLU epilogue beats the GEMV)
            return _triton(layer, x, None, True)
        return self.silu_mul(_gemv(layer, x, None) if _gemv_ready(layer, x) else layer(x))


def cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions: [B, T] -> cos, sin: [B, T, 1, D] (float32 inside, then `dtype`, as HF)."""
    freqs = positions.float()[..., None] * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


@dataclass(frozen=True)
class Kernels:
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]
    rotary_qk: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    linear: Callable[[LinearBase, Tensor, Tensor | None], Tensor]
    swiglu: Callable[[LinearBase, Tensor], Tensor]
    name: str = "eager"


EAGER = Kernels(rmsnorm, rotary_qk, linear, swiglu)


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

    fused = FusedLinear(comp(add), comp(silu_mul))
    kernels = Kernels(comp(rmsnorm), comp(rotary_qk), fused.linear, fused.swiglu, name="fused")
    _COMPILED[key] = kernels
    return kernels
