"""The fused bundle's projections: which kernel serves a decode-type projection, and what
it fuses around the matmul.

Three routes, each computing what the eager composition computes (models/kernels.py):

- `GEMV`: the few-row GEMV (models/triton_gemv.py) with the RMSNorm prologue (qkv,
  gate_up), the SwiGLU prologue (down) and the residual epilogue (o, down). A one-row
  decoder layer is then four matmul launches and nothing around them.
- `MATMUL`: the Triton matmul (models/triton_linear.py) with the SwiGLU epilogue (gate_up)
  or the residual epilogue; the RMSNorm before it is one compiled kernel.
- `LIBRARY`: the layer's own forward (cuBLAS for dense weights), the RMSNorm, SwiGLU and
  residual add each one compiled kernel.

`ROUTES` chooses by weight kind ("bf16", "fp8", "int4", "int8": `gemv_tiles.weight_kind`), by part ("linear": every projection but gate_up, which
is "gate_up": it decides whether SwiGLU is gate_up's epilogue or down's prologue) and by
row bucket. It is the switch to flip after measuring on a GPU (`scripts/bench_gemv.py`
times the GEMV against cuBLAS and the Triton matmul per shape and row count;
`scripts/profile_step.py` counts the kernels a step launches). Only CUDA calls in half
precision, without a bias, of at most `MAX_ROWS` rows take the Triton routes; every other
call (the CPU, float32, Qwen2's q/k/v bias, prefill-sized batches) takes `LIBRARY`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.models.gemv_tiles import MAX_ROWS, ROW_BUCKETS, WEIGHT_KINDS, row_bucket, weight_kind
from infer.models.layers.linear import LinearBase
from infer.models.linear_tiles import choose_config

Tensor = torch.Tensor

GEMV, MATMUL, LIBRARY = "gemv", "matmul", "library"
PARTS = ("linear", "gate_up")
# (weight kind, part) -> route for the row buckets 1, 2, 4, 8, 16 (`gemv_tiles.ROW_BUCKETS`).
# bf16: the GEMV at one row (it read every 1B and 3B matrix faster than cuBLAS), cuBLAS from
# two rows (the GEMV was no faster there). FP8: the GEMV at one row (faster than the matmul
# there: docs/benchmarks.md), the Triton matmul from two. Integer codes: the GEMV for every
# bucket (their LIBRARY is the same GEMV without its fusions; the Triton matmul takes no
# integer weights), unmeasured.
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("bf16", "linear"): (GEMV, LIBRARY, LIBRARY, LIBRARY, LIBRARY),
    ("bf16", "gate_up"): (GEMV, LIBRARY, LIBRARY, LIBRARY, LIBRARY),
    ("fp8", "linear"): (GEMV, MATMUL, MATMUL, MATMUL, MATMUL),
    ("fp8", "gate_up"): (GEMV, MATMUL, MATMUL, MATMUL, MATMUL),
    ("int4", "linear"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int4", "gate_up"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int8", "linear"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int8", "gate_up"): (GEMV, GEMV, GEMV, GEMV, GEMV),
}
INT_KINDS = ("int4", "int8")  # weight kinds the Triton matmul does not take


def check_routes(routes: dict[tuple[str, str], tuple[str, ...]]) -> None:
    """Raise a ValueError naming the entry to fix in a route table."""
    for kind in WEIGHT_KINDS:
        for part in PARTS:
            chosen = routes.get((kind, part))
            if chosen is None or len(chosen) != len(ROW_BUCKETS):
                raise ValueError(f"ROUTES[({kind!r}, {part!r})] must give one route per row bucket {ROW_BUCKETS}")
            allowed = (GEMV, LIBRARY) if kind in INT_KINDS else (GEMV, MATMUL, LIBRARY)
            if any(r not in allowed for r in chosen):
                names = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise ValueError(f"ROUTES[({kind!r}, {part!r})] = {chosen}: each must be {names}")


check_routes(ROUTES)


def table_route(kind: str, part: str, rows: int) -> str:
    """`ROUTES`' choice for a weight kind ("bf16": any dense half-precision weight, "fp8",
    "int4", "int8"), a part and a row count (more than MAX_ROWS: `LIBRARY`)."""
    if not 1 <= rows <= MAX_ROWS:
        return LIBRARY
    return ROUTES[(kind, part)][ROW_BUCKETS.index(row_bucket(rows))]


def route(layer: LinearBase, x: Tensor, part: str = "linear") -> str:
    """The route of `layer` applied to x [..., K]: the table's where a Triton kernel can
    serve the call (CUDA, half precision, no bias), else `LIBRARY`."""
    if layer.bias is not None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return LIBRARY
    return table_route(weight_kind(*layer.matrix()), part, x.numel() // x.shape[-1])


def _gemv(layer: LinearBase, x: Tensor, residual: Tensor | None = None,
          norm: tuple[Tensor, float] | None = None, swiglu: bool = False) -> Tensor:
    """The GEMV with its prologue (RMSNorm `norm` = (weight, eps), or SwiGLU of x = gate | up)
    and the residual add in its epilogue (after `combine` for a row-parallel layer, whose
    matmul is a partial sum). x: [..., K] or [..., 2K] -> [..., N]."""
    from infer.models.triton_gemv import gemv
    weight, scale = layer.matrix()
    n = weight.shape[0]
    fuse_add = residual is not None and not layer.partial_output
    y = gemv(x.reshape(-1, x.shape[-1]), weight, scale, norm_weight=None if norm is None else norm[0],
             eps=1e-5 if norm is None else norm[1], swiglu_input=swiglu,
             residual=residual.reshape(-1, n) if fuse_add and residual is not None else None)  # [M, N]
    y = layer.combine(y.view(*x.shape[:-1], n))
    return y if residual is None or fuse_add else residual + y


def _matmul(layer: LinearBase, x: Tensor, residual: Tensor | None, swiglu: bool) -> Tensor:
    """The Triton matmul with the residual add (or SwiGLU) in its epilogue; a layer whose
    matmul is a partial sum (row-parallel) adds the residual after `combine` instead."""
    from infer.models.triton_linear import triton_linear
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
    """The fused bundle's projection entries, each routed by `route` (the elementwise
    kernels they fall back to are given: compiled on the GPU, plain on the CPU)."""

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
