"""A GGUF file's tensors, kept quantized or dequantized, under Hugging Face names.

`iter_hf_tensors` yields `(hf_name, tensor)` pairs for `LlamaForCausalLM.load_hf_weights`: a
kept type's tensor (repack.py) comes as `PackedRows` where `layouts` stores its layer as codes,
any other is dequantized to float32. A `llama` file's q/k rows are un-permuted (`unpermute_rotary`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from infer.models.config import ModelConfig
from infer.models.layers.int_quant import IntLayout, PackedRows
from infer.models.llama import hf_to_fused
from infer.models.loading.gguf.reader import GGUFFile, GGUFTensor
from infer.models.loading.gguf.repack import KEPT_LAYOUTS, repack

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
EMBEDDING = "token_embd.weight"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE scaling factors: config, not a weight

GLOBAL_NAMES = {
    EMBEDDING: "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
PERMUTED_ARCHITECTURES = ("llama",)  # whose q/k rows llama.cpp's converter permutes


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor; None for a name these families do not use."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def check_tensors(gguf: GGUFFile) -> None:
    """Every tensor must be one the model has, of a type infer dequantizes; raise before loading."""
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    for tensor in gguf.tensors.values():
        if tensor.ggml_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF file {str(gguf.path)!r}: tensor {tensor.name!r} is stored as "
                f"{tensor.ggml_type.name}, which infer does not load; supported types are "
                f"{supported} (re-quantize the model to one of them, e.g. Q4_K_M or Q8_0)")
        if tensor.name != ROPE_FREQS and hf_name(tensor.name) is None:
            raise ValueError(f"GGUF file {str(gguf.path)!r} has tensor {tensor.name!r}, which a "
                             f"{gguf.architecture!r} model infer runs does not have; the file is not a "
                             "plain dense model of that family")


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as float32 in its logical (torch-order) shape."""
    values = dequantize(tensor.data, tensor.ggml_type)  # float32 (F32: a view of the file)
    return np.reshape(values, tensor.shape)


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved q/k row order: [heads * head_dim, in] back to rotate-half layout
    (rows [heads, head_dim / 2, 2] -> [heads, 2, head_dim / 2])."""
    rows = weight.shape[0]
    head_dim = rows // heads
    return (weight.reshape(heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def iter_hf_tensors(gguf: GGUFFile, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    progress: bool = True, layouts: dict[str, IntLayout] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | PackedRows]]:
    """(hf_name, tensor on `device` in `dtype`) for every weight, one at a time; `PackedRows` (CPU)
    where the layer's layout in `layouts` holds the file's codes."""
    check_tensors(gguf)
    weights = [t for t in gguf.tensors.values() if t.name != ROPE_FREQS]
    total = sum(t.n_bytes for t in weights)
    with tqdm(total=total, desc=f"reading {gguf.path.name}", unit="B", unit_scale=True,
              disable=not progress) as bar:
        for tensor in weights:
            name = hf_name(tensor.name)
            assert name is not None  # check_tensors rejected the others
            heads = _rotary_heads(tensor.name, config) if gguf.architecture in PERMUTED_ARCHITECTURES else None
            layout = (layouts or {}).get(hf_to_fused(name, config)[0].removesuffix(".weight"))
            own = KEPT_LAYOUTS.get(tensor.ggml_type)
            if layout is not None and own is not None and layout.holds(own):
                rows = repack(tensor)
                values: torch.Tensor | PackedRows = rows if heads is None else rows.take_rows(
                    unpermute_rotary(torch.arange(tensor.shape[0]), heads))
            else:
                dense = torch.from_numpy(np.require(dequantize_tensor(tensor), requirements=("C", "W")))
                values = (dense if heads is None else unpermute_rotary(dense, heads)).to(device=device, dtype=dtype)
            gguf.release(tensor.data)  # (read: its pages need not stay resident beside the copy)
            yield name, values
            bar.update(tensor.n_bytes)


def kept_layouts(gguf: GGUFFile, config: ModelConfig) -> dict[str, IntLayout]:
    """The layers (fused names) whose every part is of a kept type, with a layout holding them all."""
    parts: dict[str, list[IntLayout | None]] = {}
    for tensor in gguf.tensors.values():
        name = hf_name(tensor.name)
        if name is None or not name.endswith(".weight") or len(tensor.shape) != 2:
            continue
        module = hf_to_fused(name, config)[0].removesuffix(".weight")
        parts.setdefault(module, []).append(KEPT_LAYOUTS.get(tensor.ggml_type))
    kept = {}
    for module, layouts in parts.items():
        own = [layout for layout in layouts if layout is not None]
        if len(own) == len(layouts):
            kept[module] = IntLayout(max(lay.bits for lay in own), min(lay.group_size for lay in own))
    return kept


def _rotary_heads(gguf_name: str, config: ModelConfig) -> int | None:
    """Heads of a q (or k) projection, whose rows llama.cpp permuted; None for the others."""
    if gguf_name.endswith(".attn_q.weight"):
        return config.num_attention_heads
    if gguf_name.endswith(".attn_k.weight"):
        return config.num_key_value_heads
    return None
