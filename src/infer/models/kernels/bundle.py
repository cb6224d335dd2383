"""The decoder's kernels, as a swappable bundle passed to the model explicitly.

`EAGER` is the reference (plain PyTorch, Hugging Face's numerics); its multi-step entries (`norm_linear`,
`swiglu_linear`, `mlp`, `attend`) compose the single ones, defining the math every bundle must reproduce. The fused
bundle (`compiled_kernels`) serves the fixed-shape decode paths: each projection takes its route (routes.py) to the
GEMV (gemv.py), the Triton matmul (matmul.py) or the layer's own forward; the view fuses rotary and KV-cache write."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.models.kernels.matmul_tiles import choose_config
from infer.models.kernels.routes import GEMV, MATMUL, route
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
    """The MLP half of a decoder layer: x + down(silu_mul(gate_up(rmsnorm(x)))), x [..., H]."""
    return swiglu_linear(down, norm_linear(gate_up, x, norm_weight, eps), x)


def attend(view: AttentionView, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate q [B, T, Hq, D], k [B, T, Hkv, D]; the view caches k, v and attends -> [B, T, Hq, D]."""
    q, k = rotary_qk(q, k, cos, sin)
    return view.attend(layer, q, k, v)


def attend_rotating(view: AttentionView, layer: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
                    sin: Tensor) -> Tensor:
    """`attend` with the rotation handed to the view (which may fuse it with its cache write)."""
    return view.attend(layer, q, k, v, rotary=(cos, sin))


def add(x: Tensor, y: Tensor) -> Tensor:
    return x + y


@dataclass(frozen=True)
class Kernels:
    """What the decoder calls for its math: each entry means EAGER's function of that name."""

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


def _gemv(layer: LinearBase, x: Tensor, residual: Tensor | None = None,
          norm: tuple[Tensor, float] | None = None, swiglu: bool = False) -> Tensor:
    """The GEMV with an RMSNorm (`norm` = (weight, eps)) or SwiGLU prologue and the residual add
    (after `combine` for a row-parallel layer). x: [..., K] or [..., 2K] -> [..., N]."""
    from infer.models.kernels.gemv import gemv
    weight, scale = layer.matrix()
    n = weight.shape[0]
    fuse_add = residual is not None and not layer.partial_output
    y = gemv(x.reshape(-1, x.shape[-1]), weight, scale, norm_weight=None if norm is None else norm[0],
             eps=1e-5 if norm is None else norm[1], swiglu_input=swiglu,
             residual=residual.reshape(-1, n) if fuse_add and residual is not None else None,
             workspace=layer.workspace)  # [M, N]
    y = layer.combine(y.view(*x.shape[:-1], n))
    return y if residual is None or fuse_add else residual + y


def _matmul(layer: LinearBase, x: Tensor, residual: Tensor | None, swiglu: bool) -> Tensor:
    """The Triton matmul with the residual add (or SwiGLU) in its epilogue (row-parallel: after `combine`)."""
    from infer.models.kernels.matmul import triton_linear
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    weight, scale = layer.matrix()
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    fuse_add = residual is not None and not layer.partial_output
    res = residual.reshape(-1, n).contiguous() if fuse_add and residual is not None else None
    y = triton_linear(rows, weight, scale, choose_config(rows.shape[0], n, rows.shape[1]),
                      layer.workspace, res, swiglu)
    y = layer.combine(y.view(*x.shape[:-1], n))
    return y if residual is None or fuse_add else residual + y


class FusedLinear:
    """The fused bundle's projection entries, each routed by `route`, over the given elementwise kernels."""

    def __init__(self, add: Callable[[Tensor, Tensor], Tensor], silu_mul: Callable[[Tensor], Tensor],
                 rmsnorm: Callable[[Tensor, Tensor, float], Tensor]) -> None:
        self.add, self.silu_mul, self.rmsnorm = add, silu_mul, rmsnorm

    def _project(self, layer: LinearBase, x: Tensor, residual: Tensor | None, chosen: str) -> Tensor:
        if chosen == GEMV:
            return _gemv(layer, x, residual)
        if chosen == MATMUL:
            return _matmul(layer, x, residual, False)
        y = layer(x)
        return y if residual is None else self.add(residual, y)

    def linear(self, layer: LinearBase, x: Tensor, residual: Tensor | None) -> Tensor:
        """layer(x) (+ residual)."""
        return self._project(layer, x, residual, route(layer, x))

    def swiglu(self, layer: LinearBase, x: Tensor) -> Tensor:
        """silu_mul(layer(x)): the matmul's SwiGLU epilogue on its route."""
        chosen = route(layer, x, "gate_up")
        if chosen == MATMUL:
            return _matmul(layer, x, None, True)
        return self.silu_mul(self._project(layer, x, None, chosen))

    def _norm_linear(self, layer: LinearBase, x: Tensor, norm_weight: Tensor, eps: float, chosen: str) -> Tensor:
        if chosen == GEMV and norm_weight.dtype == x.dtype:
            return _gemv(layer, x, norm=(norm_weight.contiguous(), eps))
        return self._project(layer, self.rmsnorm(x, norm_weight, eps), None, chosen)

    def norm_linear(self, layer: LinearBase, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
        """layer(rmsnorm(x)): the GEMV's RMSNorm prologue on its route."""
        return self._norm_linear(layer, x, norm_weight, eps, route(layer, x))

    def swiglu_linear(self, layer: LinearBase, gate_up: Tensor, residual: Tensor | None) -> Tensor:
        """layer(silu_mul(gate_up)) (+ residual): the GEMV's SwiGLU prologue on its route."""
        chosen = route(layer, gate_up)
        if chosen == GEMV:
            return _gemv(layer, gate_up, residual, swiglu=True)
        return self._project(layer, self.silu_mul(gate_up), residual, chosen)

    def mlp(self, gate_up: LinearBase, down: LinearBase, x: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
        """x + down(silu_mul(gate_up(rmsnorm(x)))): SwiGLU as gate_up's epilogue on the
        MATMUL route, else as down's prologue (`swiglu_linear`)."""
        chosen = route(gate_up, x, "gate_up")
        if chosen == MATMUL:
            return self.linear(down, _matmul(gate_up, self.rmsnorm(x, norm_weight, eps), None, True), x)
        return self.swiglu_linear(down, self._norm_linear(gate_up, x, norm_weight, eps, chosen), x)


def fused_kernels(wrap: Callable[[Callable], Callable]) -> Kernels:
    """The fused bundle, its elementwise steps passed through `wrap` (`torch.compile`, or the
    identity for the CPU tests' comparison with EAGER)."""
    fused = FusedLinear(wrap(add), wrap(silu_mul), wrap(rmsnorm))
    return Kernels(fused.rmsnorm, wrap(rotary_qk), fused.linear, fused.swiglu, fused.norm_linear,
                   fused.swiglu_linear, fused.mlp, attend_rotating, name="fused")


def compiled_kernels() -> Kernels:
    """A fresh fused bundle with its elementwise steps through torch.compile, on fresh code
    objects: compiled variants are capped per code object, so each model gets its own."""

    def comp(fn: Callable) -> Callable:
        fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                   fn.__closure__)
        # fullgraph=False: past the recompile limit a new shape runs eagerly instead of failing.
        # emulate_precision_casts: round intermediates as eager does (and the GEMV prologues).
        # dynamic=None: only dimensions that change (token rows) become symbolic.
        return torch.compile(fresh, fullgraph=False, options={"emulate_precision_casts": True})

    return fused_kernels(comp)


class CompiledKernels:
    """A model's own compiled bundle, made at first use and shared by every forward over the
    model. `warmed`: whether it was compiled for prefill chunks (engine/executor/kernels.py)."""

    def __init__(self) -> None:
        self._kernels: Kernels | None = None
        self.warmed = False

    def get(self) -> Kernels:
        if self._kernels is None:
            self._kernels = compiled_kernels()
        return self._kernels
