"""Load a model: hub id, local Hugging Face directory, GGUF file or dummy shape -> (model, config).

    model, config = load_model("meta-llama/Llama-3.2-1B", dtype="bf16", device="cuda")
    model, config = load_model("/models/Llama-3.2-1B-Q4_K_M.gguf")   # llama.cpp file
    model, config = load_model("dummy:llama-3.2-3b", device="cuda")  # random weights, no files (`model_shapes`)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from infer.models.config import ModelConfig, RopeScaling
from infer.models.layers.linear import QUANTIZATIONS
from infer.models.layers.rotary import Rotary
from infer.models.layers.shard import ModelShard
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.gguf.path import is_gguf_path
from infer.models.loading.layouts import LayerLayouts, apply_layouts, head_layouts
from infer.models.loading.readers import DummyReader, GGUFReader, SafetensorsReader, WeightReader

__all__ = ["DUMMY_PREFIX", "LOAD_FORMATS", "build_empty_model", "load_model", "model_shapes", "open_reader",
           "read_model_config", "resolve_dtype"]

DUMMY_PREFIX = "dummy:"
LOAD_FORMATS = ("auto", "safetensors", "dummy")

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def _llama3_shape(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int,
                  tied: bool, rope_factor: float) -> ModelConfig:
    return ModelConfig(
        vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
        head_dim=head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=rope_factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=tied, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))


model_shapes: dict[str, ModelConfig] = {
    "llama-3.2-1b": _llama3_shape(2048, 8192, 16, 32, 64, tied=True, rope_factor=32.0),
    "llama-3.2-3b": _llama3_shape(3072, 8192, 28, 24, 128, tied=True, rope_factor=32.0),
    "llama-3.1-8b": _llama3_shape(4096, 14336, 32, 32, 128, tied=False, rope_factor=8.0),
}


def resolve_dtype(dtype: torch.dtype | str, device: torch.device, config_dtype: str | None = None) -> torch.dtype:
    """'auto' -> the config's dtype, else bfloat16 on CUDA / float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in set(DTYPES.values()):
            raise ValueError(f"dtype {dtype} is not supported; choose one of {_dtype_choices()}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        if config_dtype and config_dtype.lower() in DTYPES:
            return DTYPES[config_dtype.lower()]
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if key not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {_dtype_choices()}")
    return DTYPES[key]


def _dtype_choices() -> str:
    return "'auto', " + ", ".join(repr(k) for k in DTYPES) + " or a torch float dtype"


def open_reader(name_or_path: str | os.PathLike[str], load_format: str = "auto") -> WeightReader:
    """The reader of what `name_or_path` names (load_format="dummy": a dummy reader of its shapes)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    name = os.fspath(name_or_path)
    shape = name.removeprefix(DUMMY_PREFIX)
    if name.startswith(DUMMY_PREFIX) or (load_format == "dummy" and shape in model_shapes
                                         and not Path(name).is_dir()):
        if load_format == "safetensors":
            raise ValueError(f"{name!r} names a dummy shape; it has no weight files, use "
                             "load_format='dummy' or 'auto'")
        if shape not in model_shapes:
            raise ValueError(f"unknown dummy shape {shape!r}; choose one of {sorted(model_shapes)}")
        return DummyReader(model_shapes[shape])
    reader: WeightReader
    if is_gguf_path(name):
        if load_format == "safetensors":
            raise ValueError(f"{name!r} is a GGUF file, not safetensors: use load_format='auto'")
        reader = GGUFReader.open(Path(name).expanduser())
    else:
        reader = SafetensorsReader.open(name)
    if load_format == "dummy":
        return DummyReader(reader.config, reader.config_dtype)
    return reader


def read_model_config(name_or_path: str, load_format: str = "auto") -> ModelConfig:
    """The config of what `load_model` would load, without reading any weights."""
    return open_reader(name_or_path, load_format).config


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    quantization: str | None = None,
    shard: ModelShard | None = None,
    max_seq_len: int | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build a model with its weights; returns (model in eval mode, no grad; config).

    `quantization` ("fp8", "int4", "int8") quantizes as weights load; a quantized checkpoint
    loads as stored whatever is asked (a GGUF file unless a quantization is asked). With a `shard`
    the model is that rank's part (the config is still the whole model's). `max_seq_len` is
    checked against the attention window before any weight is read."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    reader = open_reader(name_or_path, load_format)
    if max_seq_len is not None:
        reader.config.check_context(max_seq_len)
    device = torch.device(device)
    if device.type == "meta" and not isinstance(reader, DummyReader):
        raise ValueError("device='meta' holds no data: use it only with load_format='dummy'")
    layouts = plan_layouts(reader, quantization, shard)
    return build_model(reader, resolve_dtype(dtype, device, reader.config_dtype), device,
                       reader.stored_quantization or quantization, shard, layouts), reader.config


def plan_layouts(reader: WeightReader, quantization: str | None, shard: ModelShard | None) -> LayerLayouts:
    """The layers stored as integer codes in a layout of their own (beyond what `quantization` makes)."""
    if reader.stored_quantization is not None and reader.int_layouts:
        return dict(reader.int_layouts)  # an integer checkpoint (its reader refuses a shard)
    if shard is not None:
        return {}
    if quantization is None:
        return dict(reader.int_layouts)
    return head_layouts(reader.config, quantization)


def build_model(reader: WeightReader, dtype: torch.dtype, device: torch.device, quantization: str | None,
                shard: ModelShard | None = None, layouts: LayerLayouts | None = None) -> LlamaForCausalLM:
    """The model (or a shard's part) filled with the reader's tensors, eval mode, no grad (meta: empty)."""
    layouts = layouts or {}
    model = build_empty_model(reader.config, dtype, device, quantization, shard, layouts)
    if device.type != "meta":
        parts = None if shard is None else model.checkpoint_parts()
        model.load_hf_weights(reader.tensors(device, dtype, parts, layouts))
    model.eval().requires_grad_(False)
    return model


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                      quantization: str | None = None, shard: ModelShard | None = None,
                      layouts: LayerLayouts | None = None) -> LlamaForCausalLM:
    """The model (or a shard's part) with uninitialised parameters on `device` (quantized ones keep
    their dtype), the `layouts`' layers stored as integer codes; buffers valid."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, quantization, shard)
        apply_layouts(model, layouts or {})
    # as `to_empty`, but by shape: `empty_like` on meta tensors imports sympy (slow, large)
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()  # to_empty replaces each Parameter separately: restore the tie
    model.rotary = Rotary(model.config).to(device)  # inv_freq stays float32, as in HF
    stale = [name for name, _ in model.named_buffers() if not name.startswith("rotary.")]
    if stale:
        raise RuntimeError(f"build_empty_model does not know how to initialise buffers {stale}")
    return model
