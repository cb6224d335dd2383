"""Executor: where a runner's KV pools and forward functions come from.

The runners build every pool and forward function through their executor. `LOCAL` builds
them in this process (`LocalExecutor`); tensor parallelism
(infer.distributed.mirror) builds each on every rank, each rank with its shard of the model.
"""

from __future__ import annotations

from typing import Protocol

from infer.cache.factory import make_cache_pool
from infer.cache.protocol import CachePoolProtocol
from infer.engine.config import EngineConfig
from infer.engine.executor import make_forward
from infer.engine.executor.forward import ForwardFn
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM


class Executor(Protocol):
    def make_pool(self, model: LlamaForCausalLM, config: EngineConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        """The KV pool of `model` (its dtype and device) sized by `config`."""
        ...

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, use_cuda_graphs: bool,
                     max_batch_size: int, shapes: list[tuple[int, bool]], kernels: Kernels = EAGER,
                     sample_widths: tuple[int, ...] = (),
                     small_batch_shapes: list[tuple[int, bool]] | None = None,
                     verify_modes: tuple[str, ...] = (), sampling_batch_max: int | None = None) -> ForwardFn:
        """`make_forward`'s forward function of `model` through `pool` (a pool this executor made)."""
        ...


class LocalExecutor:
    """Pools and forward functions in this process."""

    def make_pool(self, model: LlamaForCausalLM, config: EngineConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        param = next(model.parameters())
        kwargs: dict[str, object] = dict(max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                                         dtype=param.dtype, device=param.device)
        if config.kv_cache_backend == "paged":
            kwargs.update(block_size=config.block_size, num_blocks=config.num_blocks,
                          memory_budget_bytes=config.kv_cache_memory_bytes, enable_prefix_caching=prefix_caching)
        return make_cache_pool(config.kv_cache_backend, model.config, **kwargs)

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, use_cuda_graphs: bool,
                     max_batch_size: int, shapes: list[tuple[int, bool]], kernels: Kernels = EAGER,
                     sample_widths: tuple[int, ...] = (),
                     small_batch_shapes: list[tuple[int, bool]] | None = None,
                     verify_modes: tuple[str, ...] = (), sampling_batch_max: int | None = None) -> ForwardFn:
        return make_forward(model, pool, use_cuda_graphs, max_batch_size, shapes, kernels=kernels,
                            sample_widths=sample_widths, small_batch_shapes=small_batch_shapes,
                            verify_modes=verify_modes, sampling_batch_max=sampling_batch_max)


LOCAL = LocalExecutor()
