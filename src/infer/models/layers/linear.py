"""Linear layers: one `LinearBase`, a quantization method, and a tensor-parallel setting.

`LinearBase(in, out, method, parallel, bias)` is y = x W^T (+ b). The method (as vLLM's `QuantizeMethodBase`)
creates, loads and applies W: `UNQUANTIZED`, `FP8` (E4M3, a float32 scale per row) or `IntWeights(layout)` (4/8-bit
group codes). `parallel` (parallel.py) says which part of the whole matrix the layer holds; the kernel routes read
only `matrix()` and `partial_output`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.kernels.gemv_tiles import MAX_ROWS
from infer.models.kernels.matmul_tiles import SplitWorkspace, choose_config
from infer.models.layers.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_rows
from infer.models.layers.int_quant import IntLayout, IntScales, PackedRows, default_group, dequantize_int, quantize_rtn
from infer.models.layers.parallel import REPLICATED, Parallel

QUANTIZATIONS = (None, "fp8", "int4", "int8")
INT_QUANTIZATIONS = {"int4": 4, "int8": 8}  # quantized at load, groups of up to 128 columns
# values of an integer W dequantized at a time where the GEMV does not serve (never the whole matrix)
DENSE_CHUNK = {"cpu": 1 << 17, "cuda": 1 << 26}


class QuantMethod(Protocol):
    """How a `LinearBase` stores W: create, load, apply."""

    name: str | None  # the `quantization` it implements: None or "fp8"
    checkpoint_params: tuple[str, ...]  # the layer's parameters a checkpoint supplies
    fixed_dtype_params: tuple[str, ...]  # parameters whose dtype `.to(dtype)` keeps

    def create_weights(self, layer: LinearBase) -> None:
        """Register the layer's weight parameters ([out, in] W and what it needs)."""
        ...

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor, row_offset: int | None, name: str) -> None:
        """Copy a checkpoint tensor [rows, in] into rows row_offset.. of W (None: all of W)."""
        ...

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        """A quantized checkpoint's scale of `rows` rows from row_offset."""
        ...

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """The local matmul x [..., in] -> [..., out] (no bias, not combined across ranks)."""
        ...

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor | IntScales | None]:
        """What the Triton kernels read: (W, per-row scale [out] or None), or (codes, `IntScales`)."""
        ...

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        """W as a dense [out, in] matrix in `dtype` (None: the stored dtype, float32 if quantized)."""
        ...


def check_rows(stored: torch.Tensor, tensor: torch.Tensor | PackedRows, row_offset: int | None,
               name: str) -> torch.Tensor:
    """The rows of `stored` a checkpoint tensor fills; an error naming it when shapes disagree."""
    target = stored if row_offset is None else stored[row_offset:row_offset + tensor.shape[0]]
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                         f"{tuple(target.shape)}: the weights do not match this config")
    return target


def _dense_only(tensor: torch.Tensor | PackedRows, name: str, method: str) -> torch.Tensor:
    if isinstance(tensor, PackedRows):
        raise ValueError(f"tensor {name!r} is stored as {tensor.layout.name} codes, which a {method} layer does "
                         "not take: load the checkpoint with its own quantization (leave quantization unset)")
    return tensor


class Unquantized:
    """W in the model's dtype; F.linear (cuBLAS on a GPU)."""

    name = None
    checkpoint_params = ("weight",)
    fixed_dtype_params: tuple[str, ...] = ()

    def create_weights(self, layer: LinearBase) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))  # nn.Linear's initialisation

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor, row_offset: int | None, name: str) -> None:
        tensor = _dense_only(tensor, name, "dense")
        if tensor.dtype == FP8_DTYPE:
            raise ValueError(f"tensor {name!r} is stored in FP8: load the model with quantization='fp8'")
        with torch.no_grad():
            check_rows(layer.weight.data, tensor, row_offset, name).copy_(tensor)

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        raise ValueError(f"tensor {name!r} is a quantization scale: this layer is not quantized "
                         "(load the model with quantization='fp8')")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.weight, None

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return layer.weight if dtype is None else layer.weight.to(dtype)


class Fp8:
    """W in FP8 E4M3, one float32 scale per output row (weight-only quantization)."""

    name = "fp8"
    checkpoint_params = ("weight",)  # the scale comes with an FP8 tensor, or is computed at load
    fixed_dtype_params = ("weight", "weight_scale")

    def create_weights(self, layer: LinearBase) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(layer.out_features, dtype=torch.float32), requires_grad=False)

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor, row_offset: int | None, name: str) -> None:
        """Store a float8 tensor as is, else quantize per row (row-parallel: over every rank's columns)."""
        tensor = _dense_only(tensor, name, "FP8")
        target = check_rows(layer.weight.data, tensor, row_offset, name)
        with torch.no_grad():
            if tensor.dtype == FP8_DTYPE:
                target.copy_(tensor)
                return
            rows = tensor.to(device=layer.weight.device, dtype=torch.float32)
            peak = rows.abs().amax(dim=1)  # [n]
            if layer.parallel.partial_output:
                layer.parallel.collectives.all_reduce_max(peak)
            quantized, scale = quantize_fp8_rows(rows, peak)
            target.copy_(quantized)
            start = 0 if row_offset is None else row_offset
            layer.weight_scale.data[start:start + tensor.shape[0]] = scale

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        """Per row ([rows] or [rows, 1]) or per tensor (one value) scales."""
        flat = scale.reshape(-1).to(device=layer.weight_scale.device, dtype=torch.float32)
        if flat.numel() == 1:
            flat = flat.expand(rows)
        if flat.numel() != rows:
            raise ValueError(f"{name!r} holds {flat.numel()} scales for {rows} rows: only per-channel and "
                             "per-tensor FP8 scales are supported")
        start = 0 if row_offset is None else row_offset
        layer.weight_scale.data[start:start + rows] = flat

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from infer.models.kernels.matmul import triton_linear
            rows = x.reshape(-1, x.shape[-1])
            cfg = choose_config(rows.shape[0], layer.out_features, layer.in_features)
            y = triton_linear(rows, layer.weight, layer.weight_scale, cfg, layer.workspace)
            return y.view(*x.shape[:-1], layer.out_features)
        return F.linear(x, self.dense_weight(layer, x.dtype))

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.weight, layer.weight_scale

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return dequantize_fp8(layer.weight, layer.weight_scale, dtype or torch.float32)


class IntWeights:
    """W as integer codes with a scale and offset per column group (int_quant.py): `scales`, `offsets`
    [out, groups] in the model's dtype (registered first), `qweight` [out, in * bits / 8] uint8."""

    checkpoint_params = ("qweight",)  # W: loaded under the checkpoint's `weight` name
    fixed_dtype_params: tuple[str, ...] = ()  # (`.to(dtype)` leaves integer tensors alone)

    def __init__(self, layout: IntLayout) -> None:
        self.layout = layout

    @property
    def name(self) -> str:
        return self.layout.name

    def create_weights(self, layer: LinearBase) -> None:
        groups = self.layout.groups(layer.in_features)
        layer.scales = nn.Parameter(torch.ones(layer.out_features, groups), requires_grad=False)
        layer.offsets = nn.Parameter(torch.zeros(layer.out_features, groups), requires_grad=False)
        width = self.layout.packed_width(layer.in_features)
        layer.qweight = nn.Parameter(torch.zeros(layer.out_features, width, dtype=torch.uint8), requires_grad=False)

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor | PackedRows, row_offset: int | None,
                    name: str) -> None:
        """`PackedRows` convert to the layer's layout; dense rows quantize per group (round to nearest)."""
        check_rows(torch.empty(layer.out_features, layer.in_features, device="meta"), tensor, row_offset, name)
        device, dtype = layer.qweight.device, layer.scales.dtype
        if isinstance(tensor, PackedRows):
            rows = tensor.to_layout(self.layout, device, dtype)
            packed, scales, offsets = rows.packed, rows.scales, rows.offsets
        elif tensor.dtype == FP8_DTYPE:
            raise ValueError(f"tensor {name!r} is stored in FP8: load the model with quantization='fp8'")
        else:
            packed, scales, offsets = quantize_rtn(tensor.to(device), self.layout, dtype)
        start = 0 if row_offset is None else row_offset
        stop = start + tensor.shape[0]
        with torch.no_grad():
            layer.qweight.data[start:stop] = packed
            layer.scales.data[start:stop] = scales
            layer.offsets.data[start:stop] = offsets

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        raise ValueError(f"tensor {name!r} is an FP8 scale, but this layer stores {self.name} codes: the "
                         "checkpoint does not match the quantization asked for")

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """The GEMV (CUDA, up to MAX_ROWS rows), else F.linear on W dequantized in DENSE_CHUNK slices."""
        weight, ints = self.matrix(layer)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] <= MAX_ROWS:
                from infer.models.kernels.gemv import gemv
                return gemv(rows.contiguous(), weight, ints, workspace=layer.workspace).view(
                    *x.shape[:-1], layer.out_features)
            from infer.models.kernels.dequant import dequantize_on_device

            def dense(a: int, b: int) -> torch.Tensor:
                return dequantize_on_device(weight[a:b], IntScales(ints.scales[a:b], ints.offsets[a:b], self.layout))
        else:
            def dense(a: int, b: int) -> torch.Tensor:
                return dequantize_int(weight[a:b], ints.scales[a:b], ints.offsets[a:b], self.layout, x.dtype)
        step = max(1, DENSE_CHUNK["cuda" if x.is_cuda else "cpu"] // layer.in_features)
        parts = [F.linear(x, dense(a, min(a + step, layer.out_features))) for a in range(0, layer.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, IntScales]:
        return layer.qweight, IntScales(layer.scales, layer.offsets, self.layout)

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return dequantize_int(layer.qweight, layer.scales, layer.offsets, self.layout, dtype or torch.float32)

    def rows(self, layer: LinearBase, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of W, dequantized: [..., in] in the scales' dtype (an embedding's lookup)."""
        flat = ids.reshape(-1)
        w = dequantize_int(layer.qweight[flat], layer.scales[flat], layer.offsets[flat], self.layout,
                           layer.scales.dtype)
        return w.view(*ids.shape, layer.in_features)


class TiedRows:
    """W = rows start..stop-1 of `embedding`'s weight [stop - start, H] (no parameter of its own)."""

    name = None
    checkpoint_params: tuple[str, ...] = ()
    fixed_dtype_params: tuple[str, ...] = ()

    def __init__(self, embedding: nn.Embedding, start: int, stop: int) -> None:
        # held in a tuple: the embedding stays registered under the model body only
        self._embedding: tuple[nn.Embedding] = (embedding,)
        self.start, self.stop = start, stop

    def rows(self) -> torch.Tensor:
        return self._embedding[0].weight[self.start:self.stop]

    def create_weights(self, layer: LinearBase) -> None:
        pass

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor, row_offset: int | None, name: str) -> None:
        raise ValueError(f"tensor {name!r}: a tied lm_head has no weights of its own (it reads the embedding's)")

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        self.load_weight(layer, scale, row_offset, name)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.rows())

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.rows(), None

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return self.rows() if dtype is None else self.rows().to(dtype)


UNQUANTIZED = Unquantized()
FP8 = Fp8()
_METHODS: dict[str | None, QuantMethod] = {None: UNQUANTIZED, "fp8": FP8}


def quant_method(quantization: str | None, in_features: int | None = None) -> QuantMethod:
    """The method of a `quantization` (None, "fp8", "int4", "int8"); ValueError for others."""
    if quantization in INT_QUANTIZATIONS:
        if in_features is None:
            raise ValueError(f"quantization {quantization!r} needs the layer's input size")
        return IntWeights(IntLayout(INT_QUANTIZATIONS[quantization], default_group(in_features)))
    if quantization not in _METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    return _METHODS[quantization]


class LinearBase(nn.Module):
    """y = combine(x W^T + b), W [out_features, in_features] (local sizes) stored by `method`."""

    def __init__(self, in_features: int, out_features: int, method: QuantMethod = UNQUANTIZED,
                 parallel: Parallel = REPLICATED, bias: bool = False) -> None:
        super().__init__()
        if bias and parallel.kind in ("row", "vocab"):
            raise ValueError(f"a {parallel.kind}-parallel layer has no bias (it would be added once per rank)")
        self.in_features, self.out_features = in_features, out_features
        self.method, self.parallel = method, parallel
        method.create_weights(self)
        if bias:  # [out], in the model's dtype whatever W is stored as
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)
        self.workspace = SplitWorkspace()  # the Triton matmul's split-K scratch (GPU)

    @property
    def quantization(self) -> str | None:
        return self.method.name

    @property
    def partial_output(self) -> bool:
        return self.parallel.partial_output

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from its local matmul (+ bias) y [..., out_features]."""
        return self.parallel.combine(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no rows (the GEMVs take 1..16): combine still runs, as on every rank
        y = x.new_empty(*x.shape[:-1], self.out_features) if x.numel() == 0 else self.method.apply(self, x)
        return self.combine(y if self.bias is None else y + self.bias)

    def set_method(self, method: QuantMethod) -> None:
        """Store W as `method` does instead (new, uninitialised parameters; the bias stays)."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        self.method = method
        method.create_weights(self)

    def load_rows(self, tensor: torch.Tensor | PackedRows, row_offset: int | None, name: str = "weight") -> None:
        self.method.load_weight(self, tensor, row_offset, name)

    def load_scale(self, scale: torch.Tensor, row_offset: int | None, rows: int, name: str = "weight_scale") -> None:
        self.method.load_scale(self, scale, row_offset, rows, name)

    def load_bias(self, tensor: torch.Tensor, row_offset: int | None, name: str = "bias") -> None:
        if self.bias is None:
            raise ValueError(f"tensor {name!r} is a bias, but this model's layer has none: the config "
                             "does not match the weights")
        with torch.no_grad():
            check_rows(self.bias.data, tensor, row_offset, name).copy_(tensor)

    def checkpoint_params(self) -> tuple[str, ...]:
        """The parameter names (leaves) of this layer that a checkpoint must supply."""
        return self.method.checkpoint_params + (("bias",) if self.bias is not None else ())

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor | IntScales | None]:
        return self.method.matrix(self)

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W as a dense matrix [out, in] in `dtype` (export, tests)."""
        return self.method.dense_weight(self, dtype)

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        try:
            return super().__getattr__(name)
        except AttributeError:
            method = self.__dict__.get("method")
            if name == "weight" and method is not None and not method.checkpoint_params:
                return self.matrix()[0]  # a method that owns no parameter (a tied head) still has a W
            raise

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LinearBase:
        """As nn.Module's, but the method's fixed-dtype parameters (FP8) only change device."""
        fixed = {id(p) for n, p in self._parameters.items() if p is not None and n in self.method.fixed_dtype_params}
        if not fixed:
            return super()._apply(fn, recurse)

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return t.to(device=out.device) if id(t) in fixed and out.dtype != t.dtype else out

        return super()._apply(keep_dtype, recurse)


def linear_layers(module: nn.Module) -> dict[str, LinearBase]:
    """Every linear layer inside `module` by its module name (model.layers.0.self_attn.qkv_proj)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, LinearBase)}


def make_linear(in_features: int, out_features: int, quantization: str | None,
                parallel: Parallel = REPLICATED, bias: bool = False) -> LinearBase:
    return LinearBase(in_features, out_features, quant_method(quantization, in_features), parallel, bias)
