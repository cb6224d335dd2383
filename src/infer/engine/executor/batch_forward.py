"""The one forward of a model through its KV pool: a step's BatchPlan in, the logits of the
tokens it asks for out ([M, V]).

`EagerBatchForward` runs it eagerly; `GraphBatchForward` replays CUDA graphs of it, one per token-count bucket,
falling back to eager for what no graph serves. docs/architecture.md, "Executing the model".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds, build_batch
from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.staging import PlanInputs, record_graph
from infer.models.batch import WORD, ForwardBatch
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.kernels.routes import AttentionRoutes, kernels_serve
from infer.models.layers.paged_attention import BatchView
from infer.models.llama import LlamaForCausalLM


def run_model(model: LlamaForCausalLM, pool: CachePoolProtocol, batch: ForwardBatch, kernels: Kernels) -> torch.Tensor:
    """Hidden states [N, D] of a batch through the pool (its K/V written)."""
    view = BatchView(pool.k_cache, pool.v_cache, batch, pool.arrivals)
    return model.hidden_states(batch.token_ids[None], batch.rope_positions[None], view, kernels)[0]


def commit(pool: CachePoolProtocol, plan: BatchPlan) -> None:
    for slot, end in plan.ends:
        pool.set_length(slot, end)


class EagerBatchForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, kernels: Kernels = EAGER) -> None:
        self.model, self.pool, self.kernels = model, pool, kernels
        self.device = next(model.parameters()).device

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        """Logits [M, V] of the plan's wanted tokens (the pool's lengths set to the plan's)."""
        pool = self.pool
        batch = build_batch(plan, pool.tables, pool.block_size, pool.scratch_row, self.device, device_ids)
        hidden = run_model(self.model, pool, batch, self.kernels)
        commit(pool, plan)
        return self.model.logits(hidden.index_select(0, batch.logits_indices), self.kernels)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: PlanInputs  # the plan's arrays, padded to the bucket
    logits: torch.Tensor  # [N, V]
    hidden: torch.Tensor | None  # [1, N, D] the model's HiddenCapture output (an EAGLE head's target)


class GraphBatchForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, buckets: Sequence[int], max_rows: int,
                 context_width: int, kernels: Kernels = EAGER, trees: bool = False) -> None:
        """Graphs for these token buckets, over at most max_rows rows of contexts up to
        context_width; with `trees`, a second set applying tree rules (blocks up to WORD wide)."""
        self.model, self.pool, self.kernels = model, pool, kernels
        self.device = next(model.parameters()).device
        self.eager = EagerBatchForward(model, pool, kernels)
        self.max_rows, self.context_width = max_rows, context_width
        self.buckets = sorted(buckets)
        self.stream = torch.cuda.Stream(self.device)
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        # one memory pool for every graph (one replays at a time), captured largest first
        self.memory = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        if kernels_serve_model(model):  # (else every pass runs eagerly: graphs need the kernels)
            for n in reversed(self.buckets):
                for tree in (False, True) if trees else (False,):
                    self.graphs[(n, tree)] = self._capture(n, tree)
        self.capture_s = time.perf_counter() - start  # seconds the captures took
        self.replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def serves(self, plan: BatchPlan) -> bool:
        """Whether a graph serves the plan (tokens, rows, context and tree within what was captured)."""
        if not (self.graphs and plan.num_tokens <= self.buckets[-1] and plan.num_rows <= self.max_rows
                and plan.context_width <= self.context_width):
            return False
        return (AttentionRoutes.split_kv_only(max(plan.query_lens), plan.tree_width or None)
                and (not plan.tree_width or (self._bucket(plan.num_tokens), True) in self.graphs))

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def _capture(self, n: int, tree: bool) -> _Graph:
        inputs = PlanInputs(n, self.max_rows, self.device)
        tables = self.pool.tables.sync()  # (updated in place: the graph reads it at each replay)

        def run() -> torch.Tensor:
            # (a tree graph's rule is WORD wide: keys past a smaller block are past every
            # node's own position, so they stay unseen)
            batch = inputs.batch(tables, self.pool.block_size, self.pool.scratch_row, self.context_width,
                                 WORD if tree else 0)
            hidden = run_model(self.model, self.pool, batch, self.kernels)
            return self.model.logits(hidden.index_select(0, batch.logits_indices), self.kernels)

        graph, logits = record_graph(run, self.stream, self.device, self.memory)
        capture = self.model.capture  # (its tensor of this graph is one of the graph's static outputs)
        return _Graph(graph, inputs, logits, None if capture is None else capture.last)

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        if not self.serves(plan):
            return self.eager.run(plan, device_ids)
        g = self.graphs[(self._bucket(plan.num_tokens), plan.tree_width > 0)]
        g.inputs.stage(plan)
        if device_ids is not None:
            device_ids.apply(g.inputs.parts, plan.num_tokens)
        self.pool.tables.sync()  # (the graph reads the tables' device tensor in place)
        g.graph.replay()
        if g.hidden is not None:
            assert self.model.capture is not None
            self.model.capture.last = g.hidden[:, :plan.num_tokens]  # what the eager pass would have left
        commit(self.pool, plan)
        self.replays += 1
        return g.logits[:plan.num_logits]


def kernels_serve_model(model: LlamaForCausalLM) -> bool:
    """Whether the attention kernels serve the model's head size on its device (graphs need them)."""
    param = next(model.parameters())
    probe = torch.empty((1, 1, model.config.head_dim), device=param.device)
    return kernels_serve(probe)
