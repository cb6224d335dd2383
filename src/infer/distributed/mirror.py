"""The driver's side of tensor parallelism: pools and forward functions mirrored on every rank.

`TensorParallelExecutor` (an `Executor`) builds each pool and forward function here and
tells the workers to build the same for their shard of the model (the runners' start-up
code runs once, on the driver). Then:

- `MirroredPool` wraps the driver's KV pool: every operation that changes it (a slot
  allocated, grown, truncated, freed, a prompt's blocks offered to the prefix cache) is
  recorded and goes to the workers with the next message, which repeat it on their pools.
  Pool bookkeeping is deterministic, so every rank's slots, block tables and prefix caches
  are the driver's, and each rank builds a step's KV row indices itself (for a decode
  step at batch 32 and a 2048-token context those are 512 KB a step: better not sent).
- `TensorParallelForward` wraps a forward function: each call is sent to the workers, then
  run here; the workers run the same call on their shards, and the collectives inside
  (all-reduces, the lm_head's all-gather) meet. Only rank 0's results are used.

A model role placed on the driver alone (a draft with tensor_parallel_draft="driver") gets
plain local pools and forward functions. Every call must come from one thread, in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, CacheView, ViewIndices, pool_view
from infer.distributed.channel import ControlChannel
from infer.distributed.protocol import (Call, DraftLoop, Forward, MakeForward, MakePool, Message, PoolOp,
                                        PrepareDraftLoops, Sample)
from infer.engine.config import EngineConfig
from infer.engine.executor.factory import LOCAL
from infer.engine.executor.forward import ForwardFn
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM
from infer.speculative.tree import TreeChunk


class Outbox:
    """The control channel plus the pool operations waiting for the next message."""

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel
        self.pending: list[PoolOp] = []
        self.closed = False

    def record(self, op: PoolOp) -> None:
        self.pending.append(op)

    def send(self, call: Call) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is closed")
        ops, self.pending = tuple(self.pending), []
        self.channel.send(Message(ops, call))


class MirroredPool:
    """A CachePoolProtocol: the driver's pool `local`, its changes repeated on every worker."""

    def __init__(self, local: CachePoolProtocol, outbox: Outbox, pool_id: int) -> None:
        self.local, self.outbox, self.pool_id = local, outbox, pool_id
        self.max_batch_size, self.max_seq_len = local.max_batch_size, local.max_seq_len

    def _record(self, name: str, args: tuple[object, ...], result: object) -> None:
        self.outbox.record(PoolOp(self.pool_id, name, args, result))

    # -- changes: recorded ---------------------------------------------------------------
    def allocate_slot(self, initial_tokens: int = 0, prefix_token_ids: Sequence[int] | None = None) -> int:
        slot = self.local.allocate_slot(initial_tokens, prefix_token_ids)
        # (with the tokens the prefix cache served: a worker's cache must have matched as many)
        self._record("allocate_slot", (initial_tokens, None if prefix_token_ids is None else tuple(prefix_token_ids)),
                     (slot, self.local.seq_len(slot)))
        return slot

    def free_slot(self, slot: int) -> None:
        self.local.free_slot(slot)
        self._record("free_slot", (slot,), None)

    def truncate_to(self, slot: int, new_seq_len: int) -> None:
        self.local.truncate_to(slot, new_seq_len)
        self._record("truncate_to", (slot, new_seq_len), None)

    def ensure_capacity(self, slot: int, total_tokens: int) -> bool:
        ok = self.local.ensure_capacity(slot, total_tokens)
        self._record("ensure_capacity", (slot, total_tokens), ok)
        return ok

    def register_prefix(self, slot: int, token_ids: Sequence[int]) -> None:
        self.local.register_prefix(slot, token_ids)
        self._record("register_prefix", (slot, tuple(token_ids)), None)

    def commit(self, layout: BatchLayout) -> None:
        """(A mirrored forward function commits on each rank itself: this is for callers
        that commit a view of this pool by hand.)"""
        self.local.commit(layout)
        self._record("commit", (layout,), None)

    # -- reads -----------------------------------------------------------------------------
    @property
    def k_cache(self) -> torch.Tensor:
        return self.local.k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        return self.local.v_cache

    @property
    def scratch_row(self) -> int:
        return self.local.scratch_row

    def can_allocate(self, num_tokens: int) -> bool:
        return self.local.can_allocate(num_tokens)

    def seq_len(self, slot: int) -> int:
        return self.local.seq_len(slot)

    def free_token_capacity(self) -> int | None:
        return self.local.free_token_capacity()

    def total_token_capacity(self) -> int | None:
        return self.local.total_token_capacity()

    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        return self.local.rows(slot, start, end)

    def indices(self, layout: BatchLayout, context_width: int | None = None,
                out: ViewIndices | None = None) -> ViewIndices:
        return self.local.indices(layout, context_width, out)

    def view(self, layout: BatchLayout) -> CacheView:
        return pool_view(self, layout)  # (its commit goes through `commit`: recorded)

    def leak_report(self) -> list[str]:
        return self.local.leak_report()


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

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        self.outbox.send(Forward(self.forward_id, ids, layout, all_logits))
        return self.local(ids, layout, all_logits)

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        self.outbox.send(Sample(self.forward_id, ids, layout, tuple(temperatures), uniforms, tuple(greedy)))
        return self.local.sample(ids, layout, temperatures, uniforms, greedy)

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        # the workers run the verification forward only: acceptance is rank 0's alone
        self.outbox.send(Forward(self.forward_id, ids, layout, True))
        return self.local.verify(ids, layout, draft_tokens, counts, draft_probs, temperatures, greedy, uniforms)

    def draft_loop(self, ids: torch.Tensor, layout: BatchLayout, steps: int, temperatures: Sequence[float],
                   uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # every rank samples the same tokens from the same (all-gathered) logits and uniforms
        self.outbox.send(DraftLoop(self.forward_id, ids, layout, steps, tuple(temperatures), uniforms, tuple(greedy)))
        return self.local.draft_loop(ids, layout, steps, temperatures, uniforms, greedy)

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        return self.local.captured(layout, all_logits)

    def prepare_draft_loops(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        w, s = tuple(widths), tuple(steps)
        self.outbox.send(PrepareDraftLoops(self.forward_id, w, s))
        self.local.prepare_draft_loops(w, s)

    # tree speculation is not mirrored (EngineConfig refuses spec_tree with tensor_parallel_size > 1)
    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk) -> torch.Tensor:
        raise NotImplementedError("tree speculation does not run tensor-parallel")

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk, node_tokens: torch.Tensor,
                    node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                    greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("tree speculation does not run tensor-parallel")

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        raise NotImplementedError("tree speculation does not run tensor-parallel")


class TensorParallelExecutor:
    """An Executor whose pools and forward functions exist on every rank (roles in
    `mirrored`), or on the driver alone (any other role)."""

    def __init__(self, outbox: Outbox, config: EngineConfig, roles: dict[int, str], mirrored: frozenset[str]) -> None:
        self.outbox, self.config = outbox, config  # (the engine's config: the workers rebuild kernels from it)
        self.roles = roles  # id(model) -> "target" | "draft"
        self.mirrored = mirrored
        self._ids = itertools.count()
        self._pools: dict[int, MirroredPool] = {}  # id(MirroredPool) -> it
        self.forwards: list[TensorParallelForward] = []

    def _mirrored_role(self, model: LlamaForCausalLM) -> str | None:
        role = self.roles.get(id(model))
        if role is None:
            raise ValueError("this executor builds pools and forwards of the engine's own models only")
        return role if role in self.mirrored else None

    def make_pool(self, model: LlamaForCausalLM, config: EngineConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        local = LOCAL.make_pool(model, config, prefix_caching=prefix_caching)
        role = self._mirrored_role(model)
        if role is None:
            return local
        pool = MirroredPool(local, self.outbox, next(self._ids))
        self.outbox.send(MakePool(pool.pool_id, role, config, prefix_caching))
        self._pools[id(pool)] = pool
        return pool

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, use_cuda_graphs: bool,
                     max_batch_size: int, shapes: list[tuple[int, bool]], kernels: Kernels = EAGER,
                     sample_widths: tuple[int, ...] = (),
                     small_batch_shapes: list[tuple[int, bool]] | None = None,
                     verify_modes: tuple[str, ...] = (), sampling_batch_max: int | None = None) -> ForwardFn:
        role = self._mirrored_role(model)
        mirrored = self._pools.get(id(pool))
        if role is None:
            return LOCAL.make_forward(model, pool, use_cuda_graphs, max_batch_size, shapes, kernels, sample_widths,
                                      small_batch_shapes, verify_modes, sampling_batch_max)
        if mirrored is None:
            raise ValueError("a tensor-parallel forward function needs a pool made by the same executor")
        forward_id = next(self._ids)
        self.outbox.send(MakeForward(
            forward_id, role, mirrored.pool_id, self.config, use_cuda_graphs, max_batch_size,
            tuple(shapes), kernels.name, tuple(sample_widths),
            None if small_batch_shapes is None else tuple(small_batch_shapes), tuple(verify_modes),
            sampling_batch_max))
        local = LOCAL.make_forward(model, mirrored.local, use_cuda_graphs, max_batch_size, shapes, kernels,
                                   sample_widths, small_batch_shapes, verify_modes, sampling_batch_max)
        forward = TensorParallelForward(local, self.outbox, forward_id)
        self.forwards.append(forward)
        return forward
