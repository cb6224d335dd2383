"""FP8 weight quantization: per-output-channel symmetric E4M3, and the checkpoint formats.

A row w of W is stored as round_e4m3(w / s) with s = max |w| / 448 (448: the largest E4M3
value), so every row uses the format's whole range; dequantizing multiplies back by s. The
error of an element is at most half an E4M3 step at its magnitude: a relative 2^-4 of the
element (3 mantissa bits), plus s * 2^-9 near zero (the subnormal step).

(Integer checkpoints, GPTQ / AWQ / pack-quantized, are models/int_checkpoint.py's.)
Checkpoints already in FP8 use the compressed-tensors layout of public FP8 Llama releases:
`quantization_config.quant_method == "compressed-tensors"`, a config group whose weights
are 8-bit "float" with a "channel" or "tensor" strategy, tensors `*.weight` (float8_e4m3fn)
and `*.weight_scale`. Their activation settings are not used: activations stay in bf16.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.models.int_checkpoint import int_format

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def quantize_fp8_rows(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (float) -> (E4M3 [N, K], scale float32 [N]), per output row; `absmax`
    [N]: each row's max |w| when the row is wider than `weight` (a tensor-parallel shard of
    its columns), by default the rows' own."""
    w = weight.to(torch.float32)
    peak = w.abs().amax(dim=1) if absmax is None else absmax.to(torch.float32)
    scale = (peak / FP8_MAX).clamp(min=_MIN_SCALE)  # [N]
    quantized = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [N, K]
    return quantized, scale


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [N, K] and scale [N] -> [N, K] in `dtype` (computed in float32)."""
    return (quantized.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def checkpoint_quantization(raw_config: dict[str, Any]) -> str | None:
    """The quantization a checkpoint's config.json declares: None (none), "fp8"
    (compressed-tensors, 8-bit float weights), or "int4" / "int8" (GPTQ, AWQ, compressed-
    tensors pack-quantized: models/int_checkpoint.py). Anything else is an error naming it."""
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
