"""The decoder's kernels, as a swappable bundle.

`EAGER` is the reference: plain PyTorch with Hugging Face's numerics (RMSNorm in float32,
residual adds in the activation dtype, the rotary then the cache write, a projection then
its SwiGLU or residual add). Its entries that fuse several steps (`norm_linear`,
`swiglu_linear`, `mlp`, `attend`) are compositions of the single ones, so their
composition defines the math every fused bundle must reproduce.

`compiled_kernels()` returns the fused bundle for the fixed-shape decode paths: each
projection is routed (models/fused_linear.py) to the few-row GEMV with the RMSNorm or
SwiGLU prologue and the residual epilogue, to the Triton matmul with the SwiGLU or
residual epilogue, or to cuBLAS beside one `torch.compile`d kernel per elementwise step;
the rotary and the KV-cache write are one Triton kernel inside the batch view
(models/triton_rotary.py). A one-row decoder layer is then norm + qkv, rotary + KV write,
split-KV attention (its chunks combined in the same launch), o + residual, norm + gate_up,
SwiGLU + down + residual: six launches. Where a fusion does not apply (a bias, Qwen3's q/k norms before
the rotary, the CPU, float32, more rows than the GEMV serves) the fused bundle composes
the single kernels. The model receives the bundle explicitly; nothing global is patched.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.models.fused_linear import FusedLinear
from infer.models.layers.mlp import silu_mul
from infer.models.layers.norms import rmsnorm
from infer.models.layers.rotary import rotary_qk

if TYPE_CHECKING:
    from infer.models.layers.attention import AttentionView
    from infer.models.layers.linear import LinearBase

Tensor = torch.Tensor


def linear(layer: LinearBase, x: Tensor, residual: Tensor | None) -> Tensor:
    """layer(x) [..., N], plus `residual` [..., N] when given (the residual stream's add)."""
    y = layer(x)
    return y if residual is None else residual + y


def swiglu(layer: LinearBase, x: Tensor) -> Tensor:
    """silu(gate) * up of a fused gate/up projection: [..., K] -> [..., I]."""
    return silu_mul(layer(x))


def norm_linear(layer: LinearBase, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """layer(rmsnorm(x)): x [..., K] -> [..., N] (qkv and gate_up after their layer norm)."""
    return linear(layer, rmsnorm(x, norm_weight, eps), None)


def swiglu_linear(layer: LinearBase, gate_up: Tensor, residual: Tensor | None) -> Tensor:
    """layer(silu_mul(gate_up)) (+ residual): gate_up [..., 2I] -> [..., N] (down)."""
    return linear(layer, silu_mul(gate_up), residual)


def mlp(gate_up: LinearBase, down: LinearBase, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """The MLP half of a decoder layer on the residual stream x [..., H]:
    x + down(silu_mul(gate_up(rmsnorm(x))))."""
    return swiglu_linear(down, norm_linear(gate_up, x, norm_weight, eps), x)


def attend(view: AttentionView, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate q [B, T, Hq, D] and k [B, T, Hkv, D], then the view's attention (which stores
    k and v [B, T, Hkv, D] in its cache) -> [B, T, Hq, D]."""
    q, k = rotary_qk(q, k, cos, sin)
    return view.attend(layer, q, k, v)


def attend_rotating(view: AttentionView, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
                    sin: Tensor) -> Tensor:
    """`attend` with the rotation handed to the view: a cache view on a GPU rotates and
    writes its cache in one kernel."""
    return view.attend(layer, q, k, v, rotary=(cos, sin))


def add(x: Tensor, y: Tensor) -> Tensor:
    return x + y


@dataclass(frozen=True)
class Kernels:
    """What the decoder calls for its math. Each entry's meaning is EAGER's function of the
    same name; a bundle may only change how (which kernels, fused how), not what."""

    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]
    rotary_qk: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    linear: Callable[[LinearBase, Tensor, Tensor | None], Tensor]
    swiglu: Callable[[LinearBase, Tensor], Tensor]
    norm_linear: Callable[[LinearBase, Tensor, Tensor, float], Tensor]
    swiglu_linear: Callable[[LinearBase, Tensor, Tensor | None], Tensor]
    mlp: Callable[[LinearBase, LinearBase, Tensor, Tensor, float], Tensor]
    attend: Callable[[AttentionView, int, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    name: str = "eager"


EAGER = Kernels(rmsnorm, rotary_qk, linear, swiglu, norm_linear, swiglu_linear, mlp, attend)


def fused_kernels(wrap: Callable[[Callable], Callable]) -> Kernels:
    """The fused bundle, its elementwise steps (RMSNorm, the residual add, SwiGLU, the
    rotary where the view does not take it) passed through `wrap`: `torch.compile` for
    `compiled_kernels`, the identity for a bundle whose fallbacks are EAGER's functions
    (what the CPU tests compare with EAGER)."""
    fused = FusedLinear(wrap(add), wrap(silu_mul), wrap(rmsnorm))
    return Kernels(fused.rmsnorm, wrap(rotary_qk), fused.linear, fused.swiglu, fused.norm_linear,
                   fused.swiglu_linear, fused.mlp, attend_rotating, name="fused")


_COMPILED: dict[Hashable, Kernels] = {}


def compiled_kernels(key: Hashable = None) -> Kernels:
    """The fused bundle with its elementwise steps through torch.compile (token dimensions
    dynamic), one bundle per `key`.

    torch.compile keeps its compiled variants on the function's code object, with a limit
    per code object (then it silently falls back to eager). Engines for several models in
    one process (a benchmark run, a target and its draft) would share, and exhaust, that
    limit; so each key (a model's or an EAGLE head's class and shape, as `step_kernels` in
    engine/executor/kernels.py builds it) gets fresh code objects, and engines of the same
    model reuse one bundle.
    """
    if key in _COMPILED:
        return _COMPILED[key]

    def comp(fn: Callable) -> Callable:
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                   fn.__closure__)
        # fullgraph=False: past the recompile limit a new shape runs eagerly instead of failing.
        # emulate_precision_casts: Inductor rounds every intermediate to the dtype eager
        # rounds it to (by default it keeps fused intermediates in float32), so a compiled
        # RMSNorm or SwiGLU (two rows and more) rounds as EAGER and as the GEMV's prologues
        # (one row) do: a draft step and the verification of its drafts see the same inputs
        # dynamic=None (automatic): a dimension becomes symbolic once it has changed, so the
        # token dimensions (rows, chunk widths) do and the hidden sizes stay constants the
        # generated kernels index with (dynamic=True would make every size symbolic)
        return torch.compile(fresh, fullgraph=False, options={"emulate_precision_casts": True})

    kernels = fused_kernels(comp)
    _COMPILED[key] = kernels
    return kernels
