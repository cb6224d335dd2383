"""The driver's side of tensor parallelism: forward functions run on every rank, pools split by heads.

`TensorParallelExecutor` builds each pool and forward function here and has the workers build theirs; the `Outbox`
sends KV changes with each message, and `TensorParallelForward` sends each `run` as one `Invoke`. Every call must
come from one thread, in order. docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from infer.cache.block_tables import BlockTables
from infer.cache.forward_batch import BatchPlan, DeviceIds
from infer.cache.protocol import CachePoolProtocol
from infer.distributed.channel import ControlChannel
from infer.distributed.protocol import (Call, Invoke, MakeForward, MakePool, Message, PoolChanges, PoolShape,
                                        RowMove)
from infer.distributed.worker_pool import table_digest
from infer.engine.parts import CacheConfig, ExecutionConfig
from infer.engine.executor.factory import LOCAL
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.models.kernels.bundle import EAGER
from infer.models.llama import LlamaForCausalLM


class Outbox:
    """The control channel, and the split pools whose KV changes go with each message."""

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self.tables: dict[int, BlockTables] = {}  # pool id -> the driver pool's tables (followed)
        self.moves: dict[int, list[RowMove]] = {}  # pool id -> rows moved since the last message
        self.closed = False

    def send(self, call: Call) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is closed")
        changes = []
        for pool_id, tables in self.tables.items():
            entries, moves = tables.take_changes(), tuple(self.moves.pop(pool_id, ()))
            if len(entries) or moves:
                changes.append(PoolChanges(pool_id, entries, moves))
        self.channel.send(Message(tuple(changes), call))

    def digests(self) -> dict[int, str]:
        """Each split pool's block tables as a digest (a worker's must be the same)."""
        return {pool_id: table_digest(tables) for pool_id, tables in self.tables.items()}


class DriverPool:
    """The driver's pool of a split model: `local`, whose row moves also go to the workers."""

    def __init__(self, local: CachePoolProtocol, outbox: Outbox, pool_id: int) -> None:
        self.local, self.outbox, self.pool_id = local, outbox, pool_id

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - the pool's own attributes
        if name == "local":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.local, name)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.local.move_rows(src, dst)
        self.outbox.moves.setdefault(self.pool_id, []).append((tuple(src), tuple(dst)))


class TensorParallelForward:
    """A ForwardFn run on every rank: each call goes to the workers, then runs here on the
    driver's shard (`local`); the result is rank 0's."""

    def __init__(self, local: ForwardFn, outbox: Outbox, forward_id: int) -> None:
        self._local: ForwardFn | None = local
        self.outbox, self.forward_id = outbox, forward_id

    @property
    def local(self) -> ForwardFn:
        if self._local is None:
            raise RuntimeError("the tensor-parallel engine is closed")
        return self._local

    def release(self) -> None:
        """Drop the local forward function (its CUDA graphs hold the NCCL communicator)."""
        self._local = None

    def _invoke(self, method: str, *args: object) -> None:
        """Have every worker run `method(*args)` of its forward function (before rank 0 runs its own)."""
        self.outbox.send(Invoke(self.forward_id, method, args))

    # the workers' pass first, then rank 0's
    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        self._invoke("run", plan, device_ids)
        return self.local.run(plan, device_ids)


def pool_shape(pool: CachePoolProtocol) -> PoolShape:
    """How `pool` lays out its KV (its rows, scratch row last; its blocks and tables)."""
    rows = pool.k_cache.shape[1]
    if pool.scratch_row != rows - 1:
        raise ValueError(f"a split pool keeps its scratch row last: row {pool.scratch_row} of {rows}")
    tables: BlockTables = pool.tables  # type: ignore[attr-defined]
    return PoolShape(rows, pool.block_size, pool.max_batch_size, tables.max_blocks,  # type: ignore[attr-defined]
                     pool.max_seq_len, pool.k_cache.dtype)


class TensorParallelExecutor:
    """An Executor whose pools and forward functions exist on every rank (roles in `split`:
    the models split over the ranks), or on the driver alone (any other role)."""

    def __init__(self, outbox: Outbox, execution: ExecutionConfig, roles: dict[int, str], split: frozenset[str]
                 ) -> None:
        self.outbox, self.execution = outbox, execution  # (the workers rebuild their kernels from it)
        self.roles = roles  # id(model) -> "target" | "draft"
        self.split = split
        self._ids = itertools.count()
        self._pools: dict[int, DriverPool] = {}  # id(DriverPool) -> it
        self.forwards: list[TensorParallelForward] = []

    def _split_role(self, model: LlamaForCausalLM) -> str | None:
        role = self.roles.get(id(model))
        if role is None:
            raise ValueError("this executor builds pools and forwards of the engine's own models only")
        return role if role in self.split else None

    def make_pool(self, model: LlamaForCausalLM, cache: CacheConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        local = LOCAL.make_pool(model, cache, prefix_caching=prefix_caching)
        role = self._split_role(model)
        if role is None:
            return local
        pool = DriverPool(local, self.outbox, next(self._ids))
        tables: BlockTables = local.tables  # type: ignore[attr-defined]
        self.outbox.send(MakePool(pool.pool_id, role, pool_shape(local), tables.follow()))
        self.outbox.tables[pool.pool_id] = tables  # (its changes go with the messages after its MakePool)
        self._pools[id(pool)] = pool
        return pool  # type: ignore[return-value]

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        role = self._split_role(model)
        split = self._pools.get(id(pool))
        if role is None:
            return LOCAL.make_forward(model, pool, spec)
        if split is None:
            raise ValueError("a tensor-parallel forward function needs a pool made by the same executor")
        forward_id = next(self._ids)
        # (compiled kernels do not travel: the workers rebuild the bundle `kernels` names)
        self.outbox.send(MakeForward(forward_id, role, split.pool_id, self.execution, replace(spec, kernels=EAGER),
                                     spec.kernels.name))
        forward = TensorParallelForward(LOCAL.make_forward(model, split.local, spec), self.outbox, forward_id)
        self.forwards.append(forward)
        return forward
