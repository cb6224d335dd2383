"""The engine's configuration resolved once, when an engine is built (`resolve_config`):
the user's `EngineConfig` plus what the device and the model files tell, as one frozen
`ResolvedConfig` (parts.py). CUDA graphs, fused kernels, overlapped scheduling and the batch
gate default to on for CUDA devices, off on a CPU. docs/architecture.md, "Defaults and start-up".
"""

from __future__ import annotations

import logging

import torch

from infer.engine.batch_size import engine_sizes
from infer.engine.config import EngineConfig
from infer.engine.loading import LoadedModels, load_part, resolve_device
from infer.engine.parts import (CacheConfig, ExecutionConfig, ResolvedConfig, SchedulerConfig,
                                check_graphs_device)

log = logging.getLogger("infer.engine")


def check_device_options(config: EngineConfig, device: torch.device) -> list[str]:
    """ValueError for what `device` cannot do at all; the warnings for what it does slowly."""
    check_graphs_device(config.use_cuda_graphs, device)
    warnings = []
    for name in ("quantization", "draft_quantization"):
        kind = getattr(config, name)
        if device.type == "cpu" and kind in ("fp8", "int4"):
            warnings.append(f"{name}={kind!r} on a CPU decodes slower than float32 weights: a CPU has no "
                            f"{kind.upper()} matmul, so every step converts the weights back (it only saves their "
                            f"memory); leave {name} unset to decode faster here")
    return warnings


def resolve_config(config: EngineConfig, models: LoadedModels | None = None) -> ResolvedConfig:
    """`config` with every default decided, warning about slow choices, on `config.device` or
    the device of `models` already loaded. `config` is not changed."""
    device = next(models.target.parameters()).device if models is not None else resolve_device(config.device)
    for warning in check_device_options(config, device):
        log.warning(warning)
    sizes = engine_sizes(config, device, models)
    if config.max_seq_len is not None and sizes.max_seq_len < config.max_seq_len:
        log.warning("max_seq_len %d is longer than the model's context: using %d", config.max_seq_len,
                    sizes.max_seq_len)
    cuda = device.type == "cuda"
    graphs = cuda if config.use_cuda_graphs is None else config.use_cuda_graphs
    return ResolvedConfig(
        load=load_part(config, device),
        cache=CacheConfig(config.kv_cache_backend, sizes.max_batch_size, sizes.max_seq_len, config.block_size,
                          config.num_blocks if sizes.num_blocks is None else sizes.num_blocks,
                          config.kv_cache_memory_bytes, bool(config.enable_prefix_caching)),
        scheduler=SchedulerConfig(sizes.max_batch_size, config.max_num_batched_tokens, config.batching_mode,
                                  sizes.max_seq_len, config.mixed_batches),
        speculative=config.speculative_part(cuda),
        parallel=config.parallel_part(),
        execution=ExecutionConfig(graphs, graphs if config.compile_kernels is None else config.compile_kernels,
                                  cuda if config.async_scheduling is None else config.async_scheduling,
                                  config.cuda_graph_sampling_batch_max))
