"""Executor: where a runner's KV pools and forward functions come from, and which one an engine gets.

`LOCAL` builds them in this process. An engine of several ranks gets its executor from a
`ParallelRuntime` (`start_parallel`), imported by module path from `PARALLEL_STARTERS` only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import torch

from infer.cache.factory import make_cache_pool
from infer.cache.protocol import CachePoolProtocol
from infer.engine.config import EngineConfig
from infer.engine.executor import make_forward
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.engine.loading import LoadedModels
from infer.engine.parts import CacheConfig, ExecutionConfig
from infer.models.layers.shard import ModelShard
from infer.models.llama import LlamaForCausalLM


class Executor(Protocol):
    def make_pool(self, model: LlamaForCausalLM, cache: CacheConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        """The KV pool of `model` (its dtype and device) as `cache` says."""
        ...

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        """`make_forward`'s forward function of `model` through `pool` (a pool this executor made)."""
        ...


class LocalExecutor:
    """Pools and forward functions in this process."""

    def make_pool(self, model: LlamaForCausalLM, cache: CacheConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        param = next(model.parameters())
        kwargs: dict[str, object] = dict(max_batch_size=cache.max_batch_size, max_seq_len=cache.max_seq_len,
                                         dtype=param.dtype, device=param.device)
        if cache.backend == "paged":
            kwargs.update(block_size=cache.block_size, num_blocks=cache.num_blocks,
                          memory_budget_bytes=cache.memory_bytes, enable_prefix_caching=prefix_caching)
        return make_cache_pool(cache.backend, model.config, **kwargs)

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        return make_forward(model, pool, spec)


LOCAL = LocalExecutor()


class ParallelRuntime(Protocol):
    """The ranks of a multi-rank engine, seen from rank 0 (this process)."""

    @property
    def device(self) -> torch.device:
        """This rank's device (where its shard of each model loads)."""
        ...

    @property
    def shards(self) -> tuple[ModelShard, ModelShard | None]:
        """(this rank's target shard, its draft shard or None: the draft loads whole)."""
        ...

    def executor(self, models: LoadedModels, execution: ExecutionConfig) -> Executor:
        """The executor of the engine's runner, over this rank's shards of `models`."""
        ...

    def leak_report(self) -> list[str]:
        """The other ranks' leak reports."""
        ...

    def close(self) -> None:
        """End the other ranks (idempotent)."""
        ...


# "module:function" starting the runtime of an engine with tensor_parallel_size > 1
PARALLEL_STARTERS = {"tensor_parallel": "infer.distributed.driver:start_tensor_parallel"}


def start_parallel(config: EngineConfig, models: LoadedModels | None = None) -> ParallelRuntime | None:
    """The multi-rank runtime `config` asks for (its ranks started), or None for one rank."""
    if config.tensor_parallel_size == 1:
        return None
    module, name = PARALLEL_STARTERS["tensor_parallel"].split(":")
    starter: Callable[[EngineConfig, LoadedModels | None], ParallelRuntime] = getattr(
        importlib.import_module(module), name)
    return starter(config, models)


def engine_executor(parallel: ParallelRuntime | None, models: LoadedModels, execution: ExecutionConfig) -> Executor:
    """The executor an engine's runner builds with: this process's, or its ranks'."""
    return LOCAL if parallel is None else parallel.executor(models, execution)
