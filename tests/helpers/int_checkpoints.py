"""Integer-quantized checkpoints for tests, each written in its format's own packing, beside
a dense reference checkpoint holding exactly the values the codes dequantize to.

`write_int_checkpoint(dense_dir, out_dir, "gptq" | "awq", bits, group, symmetric)` quantizes
every decoder projection of a tiny Hugging Face checkpoint (helpers.checkpoints) round to
nearest with integer zero points, and packs the codes as the formats document:

- GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" or "gptq_v2"): `qweight` int32
  [K * bits / 32, N], input rows packed into words, row i * (32 / bits) + j in bits
  j * bits..; `qzeros` int32 [G, N * bits / 32] packed alike along the output columns,
  holding z - 1 in the "gptq" format (its historical off-by-one) and z in "gptq_v2";
  `scales` fp16 [G, N]; `g_idx` int32 [K] = k // group.
- AWQ (AutoAWQ GEMM): `qweight` int32 [K, N / 8], eight output columns a word, column
  c of a word in nibble position (0, 4, 1, 5, 2, 6, 3, 7)[c] (AutoAWQ packs the columns in
  the order 0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [G, N / 8] alike; `scales` fp16 [G, N].

`write_compressed_tensors(...)` has the compressed-tensors library quantize and pack the
model itself (`pack-quantized`). Every writer returns (quantized dir, reference dir).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (of eight) in each nibble, low first


def rtn_integer(w: torch.Tensor, bits: int, group: int, symmetric: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> codes [N, K], fp16 scales [N, G], integer zero points [N, G] (GPTQ's
    round to nearest: symmetric z = 2^(bits-1), s = max|w| / (2^(bits-1) - 1/2))."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scales = (g.abs().amax(-1) / (top / 2)).clamp(min=1e-8).half()
        zeros = torch.full(scales.shape, (top + 1) // 2)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-8).half()
        zeros = (-low / scales.float()).round().clamp(0, top).long()
    codes = (g / scales.float()[..., None] + zeros[..., None]).round().clamp(0, top).long()
    return codes.view(n, k), scales, zeros


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The dense [N, K] float32 value of integer codes: s * (q - z) per group."""
    n, k = codes.shape
    q = codes.view(n, k // group, group).float()
    return (scales.float()[..., None] * (q - zeros.float()[..., None])).view(n, k)


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """values [R, C] (< 2^bits) -> int32 [R, C * bits / 32]: value j of a word in bits j * bits.."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0], -1, per)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for j in range(per):
        words |= v[:, :, j] << np.uint32(bits * j)
    return words.view(np.int32)


def gptq_tensors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
                 v1: bool) -> dict[str, torch.Tensor]:
    """A layer's GPTQ tensors from codes [N, K], scales and zeros [N, G]."""
    k = codes.shape[1]
    stored_zeros = zeros - 1 if v1 else zeros
    if v1:
        stored_zeros = stored_zeros & ((1 << bits) - 1)  # z = 0 wraps, as GPTQ's packer does
    return {"qweight": torch.from_numpy(_words(codes.numpy(), bits).T.copy()),  # packed along K
            "qzeros": torch.from_numpy(_words(stored_zeros.t().contiguous().numpy(), bits)),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def awq_tensors(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer's AWQ (GEMM, 4-bit) tensors from codes [N, K], scales and zeros [N, G]."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8], AutoAWQ's column order
        v = values.numpy().reshape(values.shape[0], -1, 8)[:, :, list(AWQ_PACK_ORDER)]
        return torch.from_numpy(_words(v.reshape(values.shape[0], -1), 4))
    return {"qweight": pack(codes.t().contiguous()), "qzeros": pack(zeros.t().contiguous()),
            "scales": scales.t().contiguous()}


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)


def write_int_checkpoint(dense_dir: str | Path, out_dir: str | Path, method: str, bits: int = 4, group: int = 32,
                         symmetric: bool = True, v1: bool = True) -> tuple[Path, Path]:
    """The checkpoint in `dense_dir` quantized as `method` ("gptq" / "awq") into `out_dir`,
    and its dense reference in `out_dir`-ref; returns both directories."""
    dense_dir, out = Path(dense_dir), Path(out_dir)
    ref = out.with_name(out.name + "-ref")
    _copy_dir(dense_dir, out)
    _copy_dir(dense_dir, ref)
    quantized, reference = {}, {}
    for name, tensor in load_file(str(dense_dir / "model.safetensors")).items():
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in PROJECTIONS:
            quantized[name] = reference[name] = tensor
            continue
        codes, scales, zeros = rtn_integer(tensor, bits, group, symmetric)
        prefix = name.removesuffix(".weight")
        packed = gptq_tensors(codes, scales, zeros, bits, group, v1) if method == "gptq" else \
            awq_tensors(codes, scales, zeros)
        quantized.update({f"{prefix}.{suffix}": t for suffix, t in packed.items()})
        reference[name] = dequantized(codes, scales, zeros, group).to(tensor.dtype)
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": symmetric,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=2))
    return out, ref


def edit_quantization_config(directory: Path, **changes: object) -> None:
    """Change fields of `directory`'s quantization_config (None deletes a field)."""
    config = json.loads((directory / "config.json").read_text())
    qc = config["quantization_config"]
    for key, value in changes.items():
        if value is None:
            qc.pop(key, None)
        else:
            qc[key] = value
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def write_compressed_tensors(dense_dir: str | Path, out_dir: str | Path, bits: int = 4, group: int | None = 32,
                             symmetric: bool = True) -> tuple[Path, Path]:
    """The checkpoint quantized (min-max, as llm-compressor's observer) and packed by the
    compressed-tensors library (`pack-quantized`; group None: one group a row), and the
    reference of the library's own fake-quantized weights."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dense_dir, out = Path(dense_dir), Path(out_dir)
    ref = out.with_name(out.name + "-ref")
    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, group_size=group, symmetric=symmetric)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, config)
    dense = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            g = w.view(w.shape[0], -1, group) if group else w[:, None, :]
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            module.weight_zero_point.data.copy_(zp.view_as(module.weight_zero_point))
            dense[f"{name}.weight"] = fake_quantize(w, module.weight_scale, module.weight_zero_point, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)
    _copy_dir(dense_dir, ref)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    save_file({n: dense.get(n, t) for n, t in tensors.items()}, str(ref / "model.safetensors"),
              metadata={"format": "pt"})
    return out, ref
