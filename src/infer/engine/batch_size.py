"""The default `max_batch_size`: sized from the GPU's memory, 8 on a CPU.

`EngineConfig.max_batch_size=None` (the default) is resolved here when an engine is built,
before any weight is read (after tensor-parallel ranks start: their pools are sized by the
driver's calls): on a CUDA
device, as many sequences as a KV pool of `max_seq_len` tokens each fits in what the device
leaves after the weights, at most `GPU_MAX` (vLLM's `max_num_seqs` default); on a CPU,
`CPU_DEFAULT` (batching there buys little). The estimate reads only config files:

  weights    every model's parameters (target, draft), linear weights at 1 byte in FP8,
             divided among the tensor-parallel ranks (the embedding and head counted whole);
  KV         2 (K, V) x layers x KV heads x head dim x element bytes a token, per model,
             the heads divided among the ranks;
  budget     MEMORY_SHARE of the device's memory, less the weights and RESERVE_BYTES (CUDA
             graphs, activations, the sampler's [batch, vocab] buffers).

The paged pool then defaults to max_batch_size x max_seq_len tokens, as with a given size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.engine.config import EngineConfig
from infer.engine.loading import LoadedModels, default_model_paths, resolve_device
from infer.models.config import ModelConfig
from infer.models.loader import read_model_config

CPU_DEFAULT = 8
GPU_MAX = 256
MEMORY_SHARE = 0.85
RESERVE_BYTES = 4 << 30


@dataclass(frozen=True)
class ModelBytes:
    """One model's weight bytes and KV bytes per token on one rank."""

    weights: int
    kv_per_token: int


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one token's K and V in every layer's cache."""
    return 2 * layers * kv_heads * head_dim * element_bytes


def model_bytes(config: ModelConfig, element_bytes: int, fp8: bool = False, ranks: int = 1) -> ModelBytes:
    """Weights and KV per token of `config` (module docstring) on one of `ranks` ranks."""
    h, d = config.hidden_size, config.head_dim
    per_layer = (h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)  # q, o; k, v
                 + 3 * h * config.intermediate_size)  # gate, up, down  (norms are negligible)
    linear = config.num_hidden_layers * per_layer * (1 if fp8 else element_bytes) // ranks
    embeddings = config.vocab_size * h * element_bytes * (1 if config.tie_word_embeddings else 2)
    kv = kv_bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, d, element_bytes) // ranks
    return ModelBytes(linear + embeddings, max(1, kv))


def fitting_batch_size(models: list[ModelBytes], device_bytes: int, max_seq_len: int) -> int:
    """Sequences of `max_seq_len` tokens whose KV fits beside the weights (1..GPU_MAX)."""
    budget = MEMORY_SHARE * device_bytes - sum(m.weights for m in models) - RESERVE_BYTES
    per_sequence = max_seq_len * sum(m.kv_per_token for m in models)
    return max(1, min(GPU_MAX, int(budget // per_sequence)))


def default_max_batch_size(config: EngineConfig, device: torch.device, models: list[ModelConfig]) -> int:
    """`config.max_batch_size` when given, else the default for `device` with these model
    configs (the target first, then a draft model if any) in `config`'s dtype."""
    if config.max_batch_size is not None:
        return config.max_batch_size
    if device.type != "cuda":
        return CPU_DEFAULT
    element = 4 if config.dtype == "float32" else 2
    ranks = config.tensor_parallel_size
    sizes = [model_bytes(m, element, fp8=quant == "fp8", ranks=ranks)
             for m, quant in zip(models, (config.quantization, config.draft_quantization), strict=False)]
    max_seq_len = min(config.max_seq_len, models[0].max_position_embeddings)
    return fitting_batch_size(sizes, torch.cuda.get_device_properties(device).total_memory, max_seq_len)


def resolve_max_batch_size(config: EngineConfig, models: LoadedModels | None = None) -> int:
    """`default_max_batch_size` for an engine about to be built on `config` (with `models`
    already loaded: their configs and device; else the config files, nothing loaded)."""
    if config.max_batch_size is not None:
        return config.max_batch_size
    if models is not None:
        device = next(models.target.parameters()).device
        configs = [models.target.config] + ([models.draft.config] if models.draft is not None else [])
    else:
        device = resolve_device(config.device)
        target, draft = default_model_paths(config)
        configs = [read_model_config(path, config.load_format) for path in (target, draft) if path is not None]
    return default_max_batch_size(config, device, configs)
