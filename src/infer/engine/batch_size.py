"""Sizing defaults: the context length (`max_seq_len`), `max_batch_size` and the KV pool.

`engine_sizes` decides them from config files only, before any weight is read: the capacity
is the KV budget (`kv_budget_bytes`) over the KV bytes a token. docs/architecture.md,
"Defaults and start-up".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.engine.config import EngineConfig
from infer.engine.loading import LoadedModels, load_part, model_dtype
from infer.models.config import ModelConfig
from infer.models.loading.loader import read_model_config

CPU_DEFAULT = 8
GPU_MAX = 256
MEMORY_SHARE = 0.85
RESERVE_BYTES = 4 << 30
CPU_KV_BYTES = 1 << 30  # a CPU's default KV pool at most (--kv-cache-memory-bytes raises it)
BATCH_SIZING_TOKENS = 1024  # the length a default GPU batch is sized for; longer sequences share the pool
_FLOAT32 = ("float32", "fp32", "float")


@dataclass(frozen=True)
class ModelBytes:
    """One model's weight bytes and KV bytes per token on one rank."""

    weights: int
    kv_per_token: int


@dataclass(frozen=True)
class Sizes:
    """What `plan_sizes` decides: num_blocks None keeps the pool's own default (batch x context)."""

    max_seq_len: int
    max_batch_size: int
    num_blocks: int | None


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one token's K and V in every layer's cache."""
    return 2 * layers * kv_heads * head_dim * element_bytes


def model_bytes(config: ModelConfig, element_bytes: int, fp8: bool = False, ranks: int = 1) -> ModelBytes:
    """Weights and KV bytes per token of `config` on one of `ranks` ranks."""
    h, d = config.hidden_size, config.head_dim
    per_layer = (h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)  # q, o; k, v
                 + 3 * h * config.intermediate_size)  # gate, up, down  (norms are negligible)
    linear = config.num_hidden_layers * per_layer * (1 if fp8 else element_bytes) // ranks
    embeddings = config.vocab_size * h * element_bytes * (1 if config.tie_word_embeddings else 2)
    kv = kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, d, element_bytes) // ranks
    return ModelBytes(linear + embeddings, max(1, kv))


def kv_budget_bytes(models: list[ModelBytes], device_bytes: int | None) -> int:
    """The KV memory: MEMORY_SHARE of a CUDA device's `device_bytes` less the weights and
    RESERVE_BYTES; CPU_KV_BYTES on a CPU (`device_bytes` None)."""
    if device_bytes is None:
        return CPU_KV_BYTES
    return int(MEMORY_SHARE * device_bytes - sum(m.weights for m in models) - RESERVE_BYTES)


def plan_sizes(config: EngineConfig, models: list[ModelConfig], device_bytes: int | None,
               element_bytes: int) -> Sizes:
    """The sizes for `models` (target first, then a draft model) on a CUDA device of
    `device_bytes` (None: a CPU); ValueError when the weights leave no room for a sequence's KV."""
    quants = (config.quantization, config.draft_quantization)
    sizes = [model_bytes(m, element_bytes, fp8=q == "fp8", ranks=config.tensor_parallel_size)
             for m, q in zip(models, quants, strict=False)]
    kv = sum(s.kv_per_token for s in sizes)
    if config.num_blocks is not None:
        capacity = config.num_blocks * config.block_size
    elif config.kv_cache_memory_bytes is not None:  # (each pool gets these bytes)
        capacity = config.kv_cache_memory_bytes // max(s.kv_per_token for s in sizes)
    else:
        capacity = max(0, kv_budget_bytes(sizes, device_bytes)) // kv
    model_max = model_context(models)
    contiguous = config.kv_cache_backend == "contiguous"
    batch = config.max_batch_size or (CPU_DEFAULT if device_bytes is None else max(1, min(
        GPU_MAX, capacity // min(config.max_seq_len or model_max, model_max, BATCH_SIZING_TOKENS))))
    if config.max_seq_len is not None:  # (above a sliding window: refused as the weights load)
        context = min([config.max_seq_len] + [m.max_position_embeddings for m in models])
    else:
        context = min(model_max, capacity // (batch if contiguous else 1))
        if context < config.block_size:
            raise ValueError(f"the KV memory left beside the weights holds {capacity} tokens"
                             + (f" for {batch} slots" if contiguous else "") + ": too few for a sequence. Set "
                             "max_seq_len and kv_cache_memory_bytes, use quantization='fp8', or a device with "
                             "more memory")
    num_blocks = None
    if not contiguous and config.num_blocks is None and config.kv_cache_memory_bytes is None \
            and batch * context > capacity:  # the pool: the capacity, at least one whole sequence
        num_blocks = -(-max(capacity, context) // config.block_size)
    return Sizes(context, batch, num_blocks)


def model_context(models: list[ModelConfig]) -> int:
    """The longest sequence every model runs: their least max_position_embeddings, within
    the target's sliding window when it has one (models/config.py refuses longer)."""
    window = models[0].sliding_window
    return min([m.max_position_embeddings for m in models] + ([window] if window is not None else []))


def engine_sizes(config: EngineConfig, device: torch.device, models: LoadedModels | None = None) -> Sizes:
    """The sizes for an engine of `config` on `device` (from `models`' configs when loaded, else
    the config files); `config` is left as it is."""
    if models is not None:
        configs = [models.target.config] + ([models.draft.config] if models.draft is not None else [])
    else:
        load = load_part(config, device)
        configs = [read_model_config(path, load.load_format) for path in (load.model, load.draft_model)
                   if path is not None]
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    element = 4 if model_dtype(config.dtype, device) in _FLOAT32 else 2
    return plan_sizes(config, configs, device_bytes, element)


def context_hint(max_seq_len: int, model_max: int) -> str:
    """How an over-length error's limit is raised: the flag, or that it is the model's own."""
    if max_seq_len < model_max:
        return f"raise max_seq_len (--max-seq-len), up to the model's context of {model_max} tokens"
    return f"use a model with a longer context ({model_max} tokens is this model's own)"
