"""make_cache_pool: build the configured KV pool for one model (the one place that
dispatches on `kv_cache_backend`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.models.config import ModelConfig


def _slotted(config: ModelConfig, *, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
             device: torch.device, **_: object) -> CachePoolProtocol:
    from infer.cache.slotted import SlottedKVCache
    return SlottedKVCache(config, max_batch_size, max_seq_len, dtype, device)


def _paged(config: ModelConfig, *, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
           device: torch.device, block_size: int = 16, num_blocks: int | None = None,
           memory_budget_bytes: int | None = None, enable_prefix_caching: bool = False) -> CachePoolProtocol:
    from infer.cache.paged import PagedKVCachePool
    return PagedKVCachePool(config, max_batch_size, max_seq_len, dtype, device, block_size=block_size,
                            num_blocks=num_blocks, memory_budget_bytes=memory_budget_bytes,
                            enable_prefix_caching=enable_prefix_caching)


_BACKENDS: dict[str, Callable[..., CachePoolProtocol]] = {"contiguous": _slotted, "paged": _paged}


def make_cache_pool(backend: str, config: ModelConfig, **kwargs: object) -> CachePoolProtocol:
    if backend not in _BACKENDS:
        raise ValueError(f"kv_cache_backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    return _BACKENDS[backend](config, **kwargs)
