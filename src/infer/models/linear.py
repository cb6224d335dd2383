"""Linear layers: the one seam for quantized (FP8) and tensor-parallel matrices.

`LinearBase` is y = x W^T with a weight loader, `load_rows(tensor, row_offset)`: a Hugging
Face tensor (q_proj, k_proj, v_proj, gate_proj, up_proj, ...) fills a block of rows of a
fused matrix (qkv_proj, gate_up_proj), converted to the layer's storage as it is read.

- `DenseLinear`: W in the model's dtype (bf16 / fp16 / fp32).
- `Fp8Linear`: W in FP8 E4M3 with one float32 scale per output row (models/quantization.py).
  Weights quantize as they load from a bf16/fp32 checkpoint, or load already quantized
  (a float8 tensor through `load_rows`, its scale through `load_scale`: the
  compressed-tensors layout). Activations stay in bf16 (weight-only quantization): the
  output is the dense layer's with the dequantized weight.

`forward(x)` is the reference computation: F.linear (FP8: on a CPU with the weight
dequantized on the fly, on a GPU through the Triton matmul that applies the scales in its
epilogue). The fused kernel bundle (models/kernels.py) sends small-batch calls of FP8
layers to the Triton matmul with the SwiGLU or residual add fused in; dense layers stay on
cuBLAS.

Tensor parallelism (infer.distributed.layers) subclasses these: a layer's `forward` is its
local matmul followed by `combine`, which completes the output across ranks (identity
here; a sum for row-parallel layers, whose `partial_output` tells the fused kernels not to
add the residual before it; a concatenation for a vocabulary-parallel lm_head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear_tiles import SplitWorkspace, choose_config
from infer.models.quantization import FP8_DTYPE, dequantize_fp8, quantize_fp8_rows

QUANTIZATIONS = (None, "fp8")


class LinearBase(nn.Module):
    """y = x W^T, W [out_features, in_features]."""

    in_features: int
    out_features: int
    workspace: SplitWorkspace  # the Triton matmul's split-K scratch (GPU)
    # the local matmul yields a partial sum that `combine` completes (row-parallel layers):
    # a residual add must come after `combine`, not inside the matmul's epilogue
    partial_output: bool = False

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from its local matmul's y [..., out_features]: y itself here;
        tensor-parallel layers sum it over their ranks or concatenate the ranks' columns."""
        return y

    def load_rows(self, tensor: torch.Tensor, row_offset: int | None, name: str = "weight") -> None:
        """Copy a checkpoint tensor [rows, in] into rows row_offset.. of W (None: all of W)."""
        raise NotImplementedError

    def load_scale(self, scale: torch.Tensor, row_offset: int | None, rows: int, name: str = "weight_scale") -> None:
        """A quantized checkpoint's scale of `rows` rows from row_offset."""
        raise ValueError(f"tensor {name!r} is a quantization scale: this layer is not quantized "
                         "(load the model with quantization='fp8')")

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(stored W, per-row scale or None): what the Triton matmul reads."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """W as a dense matrix in the activation dtype [out, in] (export, tests)."""
        raise NotImplementedError

    def _rows(self, stored: torch.Tensor, tensor: torch.Tensor, row_offset: int | None, name: str) -> torch.Tensor:
        target = stored if row_offset is None else stored[row_offset:row_offset + tensor.shape[0]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                             f"{tuple(target.shape)}: the weights do not match this config")
        return target


class DenseLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation
        self.workspace = SplitWorkspace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(F.linear(x, self.weight))

    def load_rows(self, tensor: torch.Tensor, row_offset: int | None, name: str = "weight") -> None:
        if tensor.dtype == FP8_DTYPE:
            raise ValueError(f"tensor {name!r} is stored in FP8: load the model with quantization='fp8'")
        with torch.no_grad():
            self._rows(self.weight.data, tensor, row_offset, name).copy_(tensor)

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, None

    def dense_weight(self) -> torch.Tensor:
        return self.weight


class Fp8Linear(LinearBase):
    def __init__(self, in_features: int, out_features: int, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.act_dtype = act_dtype  # the model's dtype: what dense_weight() returns
        self.workspace = SplitWorkspace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from infer.models.triton_linear import triton_linear
            rows = x.reshape(-1, x.shape[-1])
            y = triton_linear(rows, self.weight, self.weight_scale, choose_config(rows.shape[0], self.out_features,
                                                                                  self.in_features), self.workspace)
            return self.combine(y.view(*x.shape[:-1], self.out_features))
        return self.combine(F.linear(x, self.dense_weight().to(x.dtype)))

    def load_rows(self, tensor: torch.Tensor, row_offset: int | None, name: str = "weight") -> None:
        """A float8 tensor is stored as it is (its scale comes through `load_scale`); any
        other dtype is quantized per row here."""
        target = self._rows(self.weight, tensor, row_offset, name)
        with torch.no_grad():
            if tensor.dtype == FP8_DTYPE:
                target.copy_(tensor)
                return
            rows = tensor.to(device=self.weight.device, dtype=torch.float32)
            quantized, scale = quantize_fp8_rows(rows, self.row_absmax(rows))
            target.copy_(quantized)
            start = 0 if row_offset is None else row_offset
            self.weight_scale[start:start + tensor.shape[0]] = scale

    def row_absmax(self, rows: torch.Tensor) -> torch.Tensor:
        """max |w| of each row of rows [n, in] (float32) -> [n]: what its scale is set from. A
        row-parallel layer takes it over every rank's columns, so its rows quantize as the
        whole matrix's would."""
        return rows.abs().amax(dim=1)

    def load_scale(self, scale: torch.Tensor, row_offset: int | None, rows: int, name: str = "weight_scale") -> None:
        """Per row ([rows] or [rows, 1]) or per tensor (one value) scales."""
        flat = scale.reshape(-1).to(device=self.weight_scale.device, dtype=torch.float32)
        if flat.numel() == 1:
            flat = flat.expand(rows)
        if flat.numel() != rows:
            raise ValueError(f"{name!r} holds {flat.numel()} scales for {rows} rows: only per-channel and "
                             "per-tensor FP8 scales are supported")
        start = 0 if row_offset is None else row_offset
        with torch.no_grad():
            self.weight_scale[start:start + rows] = flat

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.weight_scale

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, self.act_dtype)


def make_linear(in_features: int, out_features: int, quantization: str | None) -> LinearBase:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features)
    return DenseLinear(in_features, out_features)
