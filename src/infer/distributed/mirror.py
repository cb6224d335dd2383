"""The driver's side of tensor parallelism: pools and forward functions mirrored on every rank.

`TensorParallelExecutor` (an `Executor`) builds each pool and forward function here and
tells the workers to build the same for their shard of the model (the runners' start-up
code runs once, on the driver). Then:

- `MirroredPool` wraps the driver's KV pool: every operation that changes it (a slot
  allocated, grown, truncated, freed, a prompt's blocks offered to the prefix cache, an
  accepted tree path's rows moved into place) is recorded and goes to the workers with the
  next message, which repeat it on their pools. Pool bookkeeping is deterministic, so every
  rank's slots, block tables and prefix caches are the driver's, and each rank builds a
  step's KV row indices itself (for a decode step at batch 32 and a 2048-token context
  those are 512 KB a step: better not sent).
- `TensorParallelForward` wraps a forward function: each call sends the workers one
  `Invoke` of its forward part (a `sample` or `verify` is a plain forward there, a
  `verify_tree` a `tree`), then runs here; the workers run that forward on their shards,
  and the collectives inside (all-reduces, the lm_head's all-gather) meet. Only rank 0
  samples, accepts and rejects; its results are the only ones used. A draft model's whole
  round (`draft_loop`) runs on every rank: each step feeds the token the step before
  sampled, which every rank samples alike from the all-gathered logits.

A model role placed on the driver alone (a draft with tensor_parallel_draft="driver") gets
plain local pools and forward functions. Every call must come from one thread, in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds
from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, CacheView, PackedView, ViewIndices, pool_view
from infer.distributed.channel import ControlChannel
from infer.distributed.protocol import Call, Invoke, MakeForward, MakePool, Message, PoolOp
from infer.engine.config import EngineConfig
from infer.engine.executor.factory import LOCAL
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.models.kernels import EAGER
from infer.models.llama import LlamaForCausalLM
from infer.speculative.node_tree import RowTreeChunk
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

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.local.move_rows(src, dst)
        self._record("move_rows", (tuple(src), tuple(dst)), None)

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

    def view(self, layout: BatchLayout) -> CacheView | PackedView:
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

    def _invoke(self, method: str, *args: object) -> None:
        """Have every worker run `method(*args)` of its forward function (before rank 0 runs its own)."""
        self.outbox.send(Invoke(self.forward_id, method, args))

    # each call: the workers' part first (the forward only: sampling and acceptance are rank 0's), then rank 0's
    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        self._invoke("run", plan, device_ids)
        return self.local.run(plan, device_ids)

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        self._invoke("__call__", ids, layout, all_logits)
        return self.local(ids, layout, all_logits)

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        self._invoke("__call__", ids, layout, False)
        return self.local.sample(ids, layout, temperatures, uniforms, greedy)

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        self._invoke("__call__", ids, layout, True)
        return self.local.verify(ids, layout, draft_tokens, counts, draft_probs, temperatures, greedy, uniforms)

    def draft_loop(self, ids: torch.Tensor, layout: BatchLayout, steps: int, temperatures: Sequence[float],
                   uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        # each step feeds the token the step before chose: every rank samples the same tokens
        # from the same (all-gathered) logits and uniforms (the workers keep no probabilities)
        self._invoke("draft_loop", ids, layout, steps, tuple(temperatures), uniforms, tuple(greedy))
        return self.local.draft_loop(ids, layout, steps, temperatures, uniforms, greedy)

    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> torch.Tensor:
        self._invoke("tree", ids, layout, chunk)
        return self.local.tree(ids, layout, chunk)

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk,
                    node_tokens: torch.Tensor,
                    node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                    greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        self._invoke("tree", ids, layout, chunk)
        return self.local.verify_tree(ids, layout, chunk, node_tokens, node_valid, draft_probs, temperatures,
                                      greedy, uniforms)

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        return self.local.captured(layout, all_logits)

    def prepare_draft_loops(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        w, s = tuple(widths), tuple(steps)
        self._invoke("prepare_draft_loops", w, s)
        self.local.prepare_draft_loops(w, s)

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        chunks = tuple(chunks)
        self._invoke("prepare_trees", chunks)  # (the tree graphs only: no verifiers)
        self.local.prepare_trees(chunks, verify_modes)


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

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        role = self._mirrored_role(model)
        mirrored = self._pools.get(id(pool))
        if role is None:
            return LOCAL.make_forward(model, pool, spec)
        if mirrored is None:
            raise ValueError("a tensor-parallel forward function needs a pool made by the same executor")
        forward_id = next(self._ids)
        # (compiled kernels do not travel: the workers rebuild the bundle `kernels` names)
        self.outbox.send(MakeForward(forward_id, role, mirrored.pool_id, self.config, replace(spec, kernels=EAGER),
                                     spec.kernels.name))
        forward = TensorParallelForward(LOCAL.make_forward(model, mirrored.local, spec), self.outbox, forward_id)
        self.forwards.append(forward)
        return forward
