"""Quantized checkpoints: what a config.json's `quantization_config` declares, and the integer
formats read into `PackedRows` (layers/int_quant.py) without a dense copy.

`checkpoint_quantization` names it (None, "fp8", "int4", "int8") or refuses the format; `int_format` reads GPTQ,
AWQ (GEMM) and compressed-tensors `pack-quantized` settings, and `IntFormat.convert` turns a layer's tensors into
rows (w = s * (q - z)). Tensor layouts: docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.models.layers.int_quant import IntLayout, PackedRows, pack_codes

_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a word's eight sits in nibble _AWQ_ORDER[c]
METHODS = ("gptq", "awq", "pack-quantized")
_TENSORS = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales"),
            "pack-quantized": ("weight_packed", "weight_scale")}
_OPTIONAL = {"gptq": ("g_idx",), "awq": (), "pack-quantized": ("weight_zero_point", "weight_shape")}


@dataclass(frozen=True, slots=True)
class IntFormat:
    """An integer checkpoint's layout: method, bits, group size (-1: a whole row)."""

    method: str
    bits: int
    group_size: int
    symmetric: bool = True
    zeros_minus_one: bool = False  # GPTQ's "gptq" checkpoint format: qzeros hold z - 1

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def layout(self, k: int) -> IntLayout:
        """The layout of a matrix with `k` input columns."""
        return IntLayout(self.bits, k if self.group_size == -1 else self.group_size)

    def tensor_names(self) -> tuple[str, ...]:
        """The tensors of one layer (suffixes of `<layer>.`), required first."""
        return _TENSORS[self.method] + _OPTIONAL[self.method]

    def required(self) -> tuple[str, ...]:
        if self.method == "pack-quantized" and not self.symmetric:
            return _TENSORS[self.method] + ("weight_zero_point",)
        return _TENSORS[self.method]

    def convert(self, parts: dict[str, torch.Tensor], name: str) -> PackedRows:
        """One layer's tensors (by suffix) -> its rows; `name` (the layer's) for errors."""
        missing = [f"{name}.{t}" for t in self.required() if t not in parts]
        if missing:
            raise ValueError(f"checkpoint is missing {', '.join(repr(m) for m in missing)}: the weight files are "
                             "incomplete (re-download or re-save the model)")
        if self.method == "pack-quantized":
            return self._compressed_tensors(parts, name)
        codes, zeros = (_gptq if self.method == "gptq" else _awq)(parts, self.bits)  # [K, N], [G, N]
        if self.zeros_minus_one:
            zeros = zeros + 1
        g_idx = parts.get("g_idx")
        k = codes.shape[0]
        layout = self.layout(k)
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64).cpu(), torch.arange(k) // layout.group_size):
            raise ValueError(f"{name}.g_idx orders the input columns (act-order): infer loads GPTQ checkpoints "
                             "quantized without desc_act only")
        return _rows(codes.t(), parts["scales"].t(), zeros.t(), layout, name)

    def _compressed_tensors(self, parts: dict[str, torch.Tensor], name: str) -> PackedRows:
        packed = parts["weight_packed"].contiguous().view(torch.uint8)  # [N, K * bits / 8]: infer's layout
        scales = parts["weight_scale"]
        k = packed.shape[1] * 8 // self.bits
        shape = parts.get("weight_shape")
        if shape is not None and tuple(int(v) for v in shape.tolist()) != (packed.shape[0], k):
            raise ValueError(f"{name}.weight_shape is {shape.tolist()}, its codes hold [{packed.shape[0]}, {k}]: "
                             "rows whose length is not a multiple of 32 / bits are not supported")
        centre = 1 << (self.bits - 1)
        zeros = torch.full(scales.shape, centre, dtype=torch.int32)
        if not self.symmetric:
            zp = parts["weight_zero_point"].t().contiguous().view(torch.uint8)  # [G, N * bits / 8]
            zeros = _unpack_bytes(zp, self.bits).t().to(torch.int32)[:scales.shape[0]]  # stored z + centre
        layout = self.layout(k)
        offsets = -scales.to(torch.float32) * zeros.to(torch.float32)
        return PackedRows(layout, packed, scales.to(torch.float32), _checked(offsets, scales, name))


def _rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, layout: IntLayout,
          name: str) -> PackedRows:
    """Codes [N, K], scales and integer zeros [N, G] -> rows with o = -s * z."""
    s = scales.to(torch.float32)
    if tuple(s.shape) != (codes.shape[0], layout.groups(codes.shape[1])):
        raise ValueError(f"{name}: scales of shape {tuple(scales.shape)} do not fit codes [{codes.shape[0]}, "
                         f"{codes.shape[1]}] in groups of {layout.group_size}")
    offsets = _checked(-s * zeros.to(torch.float32), s, name)
    return PackedRows(layout, pack_codes(codes.contiguous(), layout.bits), s.contiguous(), offsets.contiguous())


def _checked(offsets: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    if offsets.shape != scales.shape:
        raise ValueError(f"{name}: zero points {tuple(offsets.shape)} do not match scales {tuple(scales.shape)}")
    return offsets


def _words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> their codes [..., W, 32 / bits] in bit order."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)


def _unpack_bytes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [R, B] of codes in bit order (little-endian words) -> codes [R, B * 8 / bits]."""
    if bits == 8:
        return packed
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def _gptq(parts: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    qweight, qzeros = parts["qweight"], parts["qzeros"]
    codes = _words(qweight, bits).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
    zeros = _words(qzeros, bits).reshape(qzeros.shape[0], -1)  # [G, N]
    return codes.to(torch.uint8), zeros


def _awq(parts: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.tensor(_AWQ_ORDER)

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [R, N / 8] -> [R, N]
        return _words(packed, bits)[..., order].reshape(packed.shape[0], -1)

    return columns(parts["qweight"]).to(torch.uint8), columns(parts["qzeros"])


def int_format(raw_config: dict[str, Any]) -> IntFormat | None:
    """The integer format a config.json declares (None: not integer); ValueError for unsupported ones."""
    qc = raw_config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq_format(qc)
    if method == "awq":
        return _awq_format(qc)
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        return _compressed_tensors_format(qc)
    return None


def _bits(value: Any, method: str, allowed: tuple[int, ...] = (4, 8)) -> int:
    if value not in allowed:
        raise ValueError(f"{method} checkpoint with {value}-bit weights: infer loads "
                         f"{' and '.join(map(str, allowed))}-bit {method} weights only")
    return int(value)


def _group(value: Any, method: str) -> int:
    if value is None or value == -1:
        return -1
    if not isinstance(value, int) or value < 2 or value % 2:
        raise ValueError(f"{method} checkpoint with group_size {value!r}: infer loads -1 (whole rows) or an "
                         "even group size")
    return value


def _gptq_format(qc: dict[str, Any]) -> IntFormat:
    if qc.get("desc_act"):
        raise ValueError("GPTQ checkpoint quantized with desc_act (act-order): infer loads GPTQ checkpoints "
                         "without it; re-quantize with desc_act=False, or load the bf16 model with "
                         "quantization='int4'")
    if qc.get("dynamic") or qc.get("lm_head"):
        raise ValueError("GPTQ checkpoint with per-module settings (dynamic) or a quantized lm_head: not supported")
    kind = str(qc.get("checkpoint_format", "gptq")).lower()
    if kind not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {kind!r} is not supported: infer loads 'gptq' and 'gptq_v2'")
    return IntFormat("gptq", _bits(qc.get("bits"), "GPTQ"), _group(qc.get("group_size", 128), "GPTQ"),
                     bool(qc.get("sym", True)), zeros_minus_one=kind == "gptq")


def _awq_format(qc: dict[str, Any]) -> IntFormat:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ checkpoint of version {version!r}: infer loads the GEMM layout only")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoint without zero points: infer loads zero_point=True AWQ checkpoints only")
    bits = _bits(qc.get("bits", qc.get("w_bit")), "AWQ", (4,))
    return IntFormat("awq", bits, _group(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ"), False)


def _compressed_tensors_format(qc: dict[str, Any]) -> IntFormat:
    groups = qc.get("config_groups") or {}
    formats = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "int" or w.get("strategy") not in ("group", "channel"):
            raise ValueError(f"compressed-tensors group {name!r} has weights {w}: infer loads integer weights with "
                             "a group or channel strategy in the pack-quantized format")
        if w.get("actorder"):
            raise ValueError(f"compressed-tensors group {name!r} uses actorder {w['actorder']!r}: not supported")
        if (group or {}).get("input_activations"):
            raise ValueError(f"compressed-tensors group {name!r} quantizes activations: infer keeps them in bf16 "
                             "and loads weight-only (w4a16 / w8a16) checkpoints")
        size = -1 if w.get("strategy") == "channel" else _group(w.get("group_size"), "compressed-tensors")
        formats.add(IntFormat("pack-quantized", _bits(w.get("num_bits"), "compressed-tensors"), size,
                              bool(w.get("symmetric", True))))
    if len(formats) != 1:
        raise ValueError("a pack-quantized compressed-tensors checkpoint must have one config group of "
                         f"integer weights, found {len(formats)}")
    kept = [name for name in qc.get("ignore") or [] if "lm_head" not in name]
    if kept:
        raise ValueError(f"compressed-tensors ignore list {kept} keeps decoder layers unquantized: infer loads "
                         "checkpoints whose decoder layers are all quantized")
    return formats.pop()


def checkpoint_quantization(raw_config: dict[str, Any]) -> str | None:
    """The quantization a config.json declares: None, "fp8" (compressed-tensors) or "int4" / "int8";
    ValueError naming anything else."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    fmt = int_format(raw_config)
    if fmt is not None:
        return fmt.name
    method = qc.get("quant_method")
    if method == "fp8":  # transformers' own FP8 format: weight_scale_inv blocks, not supported
        raise ValueError("quantization_config.quant_method 'fp8' (block-wise scales) is not supported: "
                         "use a compressed-tensors FP8 checkpoint or a bf16 one with quantization='fp8'")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported: infer loads GPTQ, AWQ "
                         "and compressed-tensors (FP8, pack-quantized) checkpoints, or quantizes bf16/fp32 ones "
                         "(quantization='fp8' or 'int4')")
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if not (weights.get("num_bits") == 8 and weights.get("type") == "float"
                and weights.get("strategy") in ("channel", "tensor")):
            raise ValueError(f"compressed-tensors group {name!r} has weights {weights}: only 8-bit float "
                             "weights with a channel or tensor strategy are supported (or 4- and 8-bit integer "
                             "weights in the pack-quantized format)")
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    kept = [name for name in qc.get("ignore") or [] if "lm_head" not in name]
    if kept:  # an FP8 model quantizes every decoder linear layer: these would be re-quantized
        raise ValueError(f"compressed-tensors ignore list {kept} keeps decoder layers unquantized: infer's FP8 "
                         "models keep only lm_head (and the embedding) in bf16; quantize those layers too")
    return "fp8"
