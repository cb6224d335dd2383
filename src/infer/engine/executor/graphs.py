"""CUDA graphs for the fixed-shape steps: decode, draft steps, speculative verification.

A `GraphForward` captures `model(ids, positions, CacheView(static indices))` once per
(batch bucket, width, logits mode) with persistent input tensors, the buckets and the context
width S as executor/capture.py decides (1, 2, 4, ... up to max_batch_size; S =
min(max_seq_len, MAX_GRAPH_CONTEXT)). A step pads its batch to the next captured bucket
(padding rows write to the pool's scratch row and are masked), copies ids, positions and
cache indices into the persistent tensors and replays. Anything that does not fit (wider
chunks, prefill, contexts longer than S) runs eagerly through the same model.
Replay computes the same function as eager; tests/gpu checks the tokens are identical.

Draft steps at a temperature > 0 (no top-k / top-p / repetition penalty) can also capture
the sampling itself (`sample`): softmax with per-row temperatures and inverse-CDF sampling
with staged uniforms, so a sampled draft step is one replay rather than a replay plus a
dozen small kernel launches. Verification likewise (`verify`): a small second graph reads
the verification graph's logits and runs the whole accept / recover / bonus step
(`verifier.verify_logits`), so a round's verification is two replays and one copy back
instead of some forty eager kernel launches. A draft model's whole round (`draft_loop`:
K sampled steps, each feeding the token the one before sampled) is one graph as well,
captured per (bucket, width of the first step, K, all greedy): its steps read their
columns of one index fill for the union of their positions. The speculative runner
captures the ones its policy uses at start-up (`prepare_draft_loops`); any other is
captured on first use. Tree speculation's chunks (`tree`: the verification block, a draft
model's levels) are captured per (bucket, chunk) by `prepare_trees`, with the chunk's block
mask static in the view (gather + SDPA, not the Triton kernel) and the rotary positions
computed in the graph from the staged storage positions; the tree verifier after it too
(`verify_tree`, executor/tree_graphs.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, CacheView, ViewIndices
from infer.engine.executor.capture import graph_context_width
from infer.engine.executor.forward import (
    EagerForward,
    check_tree_layout,
    chunk_tensors,
    draft_steps,
    sample_logits,
    verify_on_logits,
    verify_on_tree_logits,
)
from infer.engine.executor.spec import SMALL_BATCH_MAX, VERIFY_MODES
from infer.engine.executor.staging import (
    _capture_inputs,
    _host_indices,
    _loop_segments,
    _segments,
    _split,
    _stage_sampling,
    _Staging,
)
from infer.engine.executor.tree_graphs import (
    TREE_VERIFY_MODES,
    TreeVerifier,
    capture_tree_verifier,
    replay_tree_verifier,
    tree_verify_mode,
)
from infer.models.kernels import EAGER, Kernels
from infer.models.llama import LlamaForCausalLM
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.speculative.verifier import verify_greedy_logits, verify_logits
from infer.speculative.node_tree import RowTreeChunk
from infer.speculative.tree import TreeChunk


T = TypeVar("T")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    staging: _Staging  # int64: ids | positions | last | write_rows | gather_rows | ctx_end
    ids: torch.Tensor  # [b, w]   (views into the staged device buffer)
    positions: torch.Tensor  # [b, w] (also the view's q_pos)
    last: torch.Tensor  # [b] logits index per row (last-token mode)
    indices: ViewIndices  # write [b*w], gather [b, S], q_pos [b, w], ctx_end [b]
    out: torch.Tensor  # [b, w, V] or [b, V]; sampling graphs: probs [b, V]
    sampling: _Staging | None = None  # float64 [3, b]: temperature | greedy | uniform (sampling graphs)
    tokens: torch.Tensor | None = None  # [b] sampled ids (sampling graphs)
    hidden: torch.Tensor | None = None  # [b, w, D] the model's HiddenCapture output (an EAGLE head's target)
    # per staging host buffer: its segments, and the index segments as ViewIndices (filled in place)
    host_parts: list[tuple[dict[str, torch.Tensor], ViewIndices]] = field(default_factory=list)

    def __post_init__(self) -> None:
        b, w = self.ids.shape
        s = self.indices.gather_rows.shape[1]
        for host in self.staging.hosts:
            parts = _split(host, b, w, s)
            self.host_parts.append((parts, _host_indices(parts)))


@dataclass
class _Verifier:
    """Rejection sampling over the logits of one verification graph (same bucket and width)."""

    graph: torch.cuda.CUDAGraph
    longs: _Staging  # int64 [b * w]: draft tokens [b, w-1] | counts [b]
    floats: _Staging  # float64 [2 + w, b]: temperature | greedy | uniforms (w - 1 to accept, 1 to sample)
    draft_probs: torch.Tensor | None  # [b, w-1, V] static input (model drafts), None: one-hot q
    out: torch.Tensor  # [b, w+1] long: draft tokens | accepted | recovered or bonus token


@dataclass
class _Loop:
    """A draft round's steps in one graph (`GraphForward.draft_loop`), for one (bucket, width
    of step 1, steps)."""

    graph: torch.cuda.CUDAGraph
    staging: _Staging  # int64: ids [b, w] | positions [b, W] | write_rows [b*W] | gather_rows [b, S] | ctx_end [b]
    floats: _Staging  # float64 [2 + steps, b]: temperature | greedy | uniforms per step
    tokens: torch.Tensor  # [b, steps]
    probs: torch.Tensor | None  # [b, steps, V]; None in a greedy loop (argmax, no probabilities)
    last: tuple[torch.Tensor, torch.Tensor]  # logits columns the graph reads (held here: freed, they'd be reused)
    # per staging host buffer: ids, and the union layout's indices (filled in place)
    host_parts: list[tuple[torch.Tensor, ViewIndices]] = field(default_factory=list)


def record_graph(run: Callable[[], T], stream: torch.cuda.Stream, device: torch.device,
                 pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm `run` up on the side stream, then capture it: (graph, run's outputs). `pool`: a
    memory pool shared with other graphs (`torch.cuda.graph_pool_handle()`), for graphs of
    which only one runs at a time."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (allocator, cuBLAS workspaces)
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        out = run()
    return graph, out


class GraphForward:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, batch_sizes: Iterable[int],
                 shapes: Iterable[tuple[int, bool]], context_width: int | None = None,
                 kernels: Kernels = EAGER, sample_widths: Iterable[int] = (),
                 small_batch_shapes: Iterable[tuple[int, bool]] = (),
                 verify_modes: Iterable[str] = (), sampling_batch_max: int = SMALL_BATCH_MAX,
                 draft_probs: bool = True) -> None:
        """shapes: (width, all_logits) pairs to capture for every batch bucket; sample_widths:
        widths whose last-token step is also captured with temperature sampling on the
        device (`sample`), and small_batch_shapes: wide shapes (the draft's catch-up chunks),
        both for buckets up to `sampling_batch_max` only (their outputs, [batch, V] and wider,
        hold GPU memory per graph; above it steps replay the forward's graph and finish
        eagerly). verify_modes:
        for each all-logits width >= 2 of those buckets, capture the acceptance step too, in
        these of VERIFY_MODES: "greedy" (every row greedy: argmax prefix match), "one_hot"
        (deterministic drafts: n-gram, greedy draft rows), "draft_probs" (model drafts).
        draft_probs: whether the graphs of sampled draft rounds keep each step's probabilities
        (False: the tokens only, no [b, steps, V] output; `draft_loop` returns None for them)."""
        self.model, self.pool, self.kernels = model, pool, kernels
        self.device = next(model.parameters()).device
        self.eager = EagerForward(model, pool, kernels)
        self.context_width = context_width or graph_context_width(pool.max_seq_len)
        self.buckets = sorted(set(batch_sizes))
        self.capture_s = 0.0  # seconds spent capturing (start-up's log, engine/startup.py)
        if sampling_batch_max < 0:
            raise ValueError(f"sampling_batch_max must be >= 0, got {sampling_batch_max}")
        self.sampling_batch_max = sampling_batch_max
        self.draft_probs = draft_probs
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.samplers: dict[tuple[int, int], _Graph] = {}
        self.loops: dict[tuple[int, int, int, bool], _Loop] = {}  # draft rounds (prepare_draft_loops, or on first use)
        self.trees: dict[tuple[int, TreeChunk], _Graph] = {}  # tree chunks (prepare_trees)
        self.tree_verifiers: dict[tuple[int, TreeChunk, str], TreeVerifier] = {}
        self.stream = stream = torch.cuda.Stream(self.device)
        shapes, small = sorted(set(shapes)), sorted(set(small_batch_shapes))
        for b in self.buckets:
            for w, all_logits in shapes + (small if b <= sampling_batch_max else []):
                self.graphs[(b, w, all_logits)] = self._capture(b, w, all_logits, stream)
            for w in sorted(set(sample_widths)) if b <= sampling_batch_max else ():
                self.samplers[(b, w)] = self._capture(b, w, False, stream, sampling=True)
        modes = sorted(set(verify_modes))
        if not set(modes) <= set(VERIFY_MODES):
            raise ValueError(f"verify_modes must be among {VERIFY_MODES}, got {modes}")
        self.verifiers: dict[tuple[int, int, str], _Verifier] = {}
        for b in self.buckets:
            if modes and b <= sampling_batch_max:
                self._capture_verifiers(b, modes, stream)
        self.replays = 0
        self.sample_replays = 0  # of those, replays that also sampled
        self.verify_replays = 0  # rejection-sampling replays
        self.loop_replays = 0  # draft rounds replayed as one graph
        self.tree_replays = 0  # tree chunks (verification, draft levels)

    @torch.inference_mode()
    def _capture(self, b: int, w: int, all_logits: bool, stream: torch.cuda.Stream,
                 sampling: bool = False, chunk: TreeChunk | None = None) -> _Graph:
        """One forward graph; with a tree `chunk` (all logits, w = chunk.width) the view gets
        its static block mask and the model its rotary positions from the staged ones."""
        s = self.context_width
        size = sum(torch.Size(shape).numel() for _, shape in _segments(b, w, s))
        device = torch.zeros(size, dtype=torch.long, device=self.device)
        parts = _split(device, b, w, s)
        _capture_inputs(parts, w, self.pool.scratch_row)
        parts["last"].fill_(w - 1)
        ids, positions, last = parts["ids"], parts["positions"], parts["last"]
        indices = _host_indices(parts)  # (positions are the view's q_pos)
        block, offsets = chunk_tensors(chunk, self.device) if chunk is not None else (None, None)
        view = CacheView(self.pool.k_cache, self.pool.v_cache, indices, block=block)
        # [3, b]: temperature | greedy | uniform, the layout `_stage_sampling` fills
        params = torch.tensor([[1.0] * b, [1.0] * b, [0.5] * b], dtype=torch.float64, device=self.device)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            rotary = positions if offsets is None else positions[:, :1] + offsets[None, :]  # [b, w]
            logits = self.model(ids, rotary, view, logits_indices=None if all_logits else last,
                                kernels=self.kernels)
            if not sampling:
                return logits, None
            probs = temperature_probs(logits, params[0].float(), params[1] > 0.5)  # [b, V]
            return probs, sample_from_probs(probs, params[2])

        graph, (out, tokens) = self._record(run, stream)
        capture = self.model.capture  # the capture's tensor of this graph is one of its static outputs
        return _Graph(graph, _Staging(device), ids, positions, last, indices, out,
                      _Staging(params) if sampling else None, tokens, None if capture is None else capture.last)

    def _record(self, run: Callable[[], T], stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
        start = time.perf_counter()
        try:
            return record_graph(run, stream, self.device)
        finally:
            self.capture_s += time.perf_counter() - start

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far, of every kind."""
        return sum(map(len, (self.graphs, self.samplers, self.verifiers, self.loops, self.trees,
                             self.tree_verifiers)))

    def _capture_verifiers(self, b: int, modes: Sequence[str], stream: torch.cuda.Stream) -> None:
        """The acceptance step after each verification graph (all logits, width >= 2) of bucket b."""
        widths = sorted(w for (y, w, all_logits) in self.graphs if y == b and all_logits and w >= 2)
        if not widths:
            return
        q_buffer = None  # draft probabilities: one buffer per bucket, for the widest K
        if "draft_probs" in modes:
            vocab = self.graphs[(b, widths[-1], True)].out.shape[-1]
            q_buffer = torch.zeros((b, widths[-1] - 1, vocab), dtype=torch.float32, device=self.device)
        for w in widths:
            for mode in modes:
                q = q_buffer[:, :w - 1] if mode == "draft_probs" else None
                self.verifiers[(b, w, mode)] = self._capture_verifier(self.graphs[(b, w, True)].out, mode, q, stream)

    @torch.inference_mode()
    def _capture_verifier(self, logits: torch.Tensor, mode: str, draft_probs: torch.Tensor | None,
                          stream: torch.cuda.Stream) -> _Verifier:
        """The acceptance step reading `logits` [b, w, V] (a verification graph's output)."""
        b, w, _ = logits.shape
        longs = torch.zeros(b * w, dtype=torch.long, device=self.device)
        longs[b * (w - 1):] = w - 1  # counts
        floats = torch.full((2 + w, b), 0.5, dtype=torch.float64, device=self.device)
        floats[:2] = 1.0  # temperature 1, greedy

        def run() -> torch.Tensor:
            draft, counts = longs[:b * (w - 1)].view(b, w - 1), longs[b * (w - 1):]
            if mode == "greedy":
                return verify_greedy_logits(logits, draft, counts)
            return verify_logits(logits, floats[0].float(), floats[1] > 0.5, draft, counts, draft_probs,
                                 floats[2:].t())

        graph, out = self._record(run, stream)
        return _Verifier(graph, _Staging(longs), _Staging(floats), draft_probs, out)

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        """Whether a graph serves the layout (a packed one, a mixed step's, runs eagerly)."""
        n = len(layout.slots)
        return (not layout.packed and n <= self.buckets[-1] and max(layout.ends) <= self.context_width
                and (self._bucket(n), layout.width, all_logits) in self.graphs)

    def _bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        if not self.captured(layout, all_logits):
            return self.eager(ids, layout, all_logits)
        n = len(layout.slots)
        g = self.graphs[(self._bucket(n), layout.width, all_logits)]
        self._replay(g, ids, layout)
        return g.out[:n]

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """A last-token step, then temperature sampling on the device: (ids [n], probs [n, V]).

        temperatures: per row (1.0 for greedy rows); uniforms: CPU float64 [n]; greedy rows
        take the argmax (one-hot probs). The same function as `EagerForward.sample`.
        """
        n = len(layout.slots)
        key = (self._bucket(n), layout.width) if n <= self.buckets[-1] else None
        if key not in self.samplers or max(layout.ends) > self.context_width:
            # no sampling graph (buckets above `sampling_batch_max`): the forward's graph if it
            # has one, then the sampling eagerly (an eager forward is ~40 launches a layer:
            # H100, demo target at batch 32, T=1: ~10 ms a step against ~1.5 ms)
            return sample_logits(self(ids, layout, all_logits=False), temperatures, uniforms, greedy)
        g = self.samplers[key]
        assert g.sampling is not None and g.tokens is not None
        _stage_sampling(g.sampling, n, temperatures, greedy, uniforms[:, None])
        g.sampling.send()
        self._replay(g, ids, layout)
        self.sample_replays += 1
        return g.tokens[:n], g.out[:n]

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        """The same function as `EagerForward.verify`: the verification graph, then its
        rejection-sampling graph; [n, K+2] long on the device."""
        n, w = len(layout.slots), layout.width
        mode = "greedy" if all(greedy) else "draft_probs" if draft_probs is not None else "one_hot"
        v = self.verifiers.get((self._bucket(n), w, mode)) if n <= self.buckets[-1] else None
        if v is None or not self.captured(layout, True):
            # no acceptance graph here: the verification graph if any (as `sample`; `self`
            # runs the forward eagerly where no graph fits), then the acceptance eagerly
            return verify_on_logits(self(ids, layout, all_logits=True), draft_tokens, counts, draft_probs,
                                    temperatures, greedy, uniforms)
        self(ids, layout, all_logits=True)  # fills the logits v reads
        b = v.out.shape[0]
        longs = v.longs.next_host()
        longs[:b * (w - 1)].view(b, w - 1)[:n] = draft_tokens
        longs[b * (w - 1):][:n] = torch.tensor(list(counts), dtype=torch.long)
        _stage_sampling(v.floats, n, temperatures, greedy, uniforms)
        v.longs.send()
        v.floats.send()
        if mode == "draft_probs":
            assert v.draft_probs is not None and draft_probs is not None
            v.draft_probs[:n].copy_(draft_probs)
        v.graph.replay()
        self.verify_replays += 1
        return v.out[:n]

    def draft_loop(self, ids: torch.Tensor, layout: BatchLayout, steps: int, temperatures: Sequence[float],
                   uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The same function as `EagerForward.draft_loop` in one replay: a draft round's host
        work is one index fill for the union of its steps instead of one per step. Graphs are
        captured per (bucket, width of step 1, steps, every row greedy) by
        `prepare_draft_loops` or else on first use, for buckets up to `sampling_batch_max`;
        anything else runs the eager loop."""
        n, w = ids.shape
        if max(layout.ends) > self.context_width or layout.chunk_lens != (w + steps - 1,) * n:
            return self.eager.draft_loop(ids, layout, steps, temperatures, uniforms, greedy)
        if n > min(self.buckets[-1], self.sampling_batch_max):  # no loop graphs: step by step, each step's graph
            return draft_steps(self, ids, layout, steps, temperatures, uniforms, greedy)
        key = (self._bucket(n), w, steps, all(greedy))
        g = self.loops.get(key)
        if g is None:
            g = self.loops[key] = self._capture_loop(*key)
        g.staging.next_host()
        staged_ids, indices = g.host_parts[g.staging.turn]
        self.pool.indices(layout, self.context_width, out=indices)  # padding rows write to scratch
        staged_ids[:n] = ids
        _stage_sampling(g.floats, n, temperatures, greedy, uniforms)
        g.staging.send()
        g.floats.send()
        g.graph.replay()
        self.pool.commit(layout)
        self.loop_replays += 1
        return g.tokens[:n], (None if g.probs is None else g.probs[:n])

    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> torch.Tensor:
        """The same function as `EagerForward.tree`: the chunk's graph for the batch's bucket
        when `prepare_trees` captured one, else eagerly (a `RowTreeChunk`, dynamic trees:
        always)."""
        check_tree_layout(layout, chunk)
        n = len(layout.slots)
        g = self.trees.get((self._bucket(n), chunk)) if n <= self.buckets[-1] else None
        if g is None or max(layout.ends) > self.context_width:
            return self.eager.tree(ids, layout, chunk)
        self._replay(g, ids, layout)
        self.tree_replays += 1
        return g.out[:n]

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk,
                    node_tokens: torch.Tensor,
                    node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                    greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        """The same function as `EagerForward.verify_tree`: the tree graph, then its verifier
        graph where `prepare_trees` captured both; else the verifier runs eagerly."""
        n = len(layout.slots)
        key = (self._bucket(n), chunk, tree_verify_mode(greedy, draft_probs)) if n <= self.buckets[-1] else None
        v = self.tree_verifiers.get(key) if key is not None else None
        logits = self.tree(ids, layout, chunk)  # [n, N+1, V] (the buffer v reads, when v exists)
        if v is None or max(layout.ends) > self.context_width:
            return verify_on_tree_logits(chunk.shape, logits, node_tokens, node_valid, draft_probs, temperatures,
                                         greedy, uniforms)
        self.verify_replays += 1
        return replay_tree_verifier(v, node_tokens, node_valid, draft_probs, temperatures, greedy, uniforms)

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        """Capture a graph per (batch bucket, chunk): the target's verification block, a draft
        model's levels. Static: the block mask and the rotary offsets are the chunk's. For a
        verification chunk (the whole block) and buckets up to `sampling_batch_max`, the tree
        verifier in `verify_modes` (of TREE_VERIFY_MODES) too."""
        chunks, modes = list(chunks), sorted(set(verify_modes))
        if not set(modes) <= set(TREE_VERIFY_MODES):
            raise ValueError(f"verify_modes must be among {TREE_VERIFY_MODES}, got {modes}")
        for b in self.buckets:
            for chunk in chunks:
                if (b, chunk) not in self.trees:
                    self.trees[(b, chunk)] = self._capture(b, chunk.width, True, self.stream, chunk=chunk)
                if chunk.first_row or chunk.width != chunk.shape.num_nodes + 1 or b > self.sampling_batch_max:
                    continue
                logits = self.trees[(b, chunk)].out  # [b, N+1, V]
                q = torch.zeros((b, chunk.width - 1, logits.shape[-1]), dtype=torch.float32, device=self.device) \
                    if "draft_probs" in modes else None
                for mode in modes:
                    if (b, chunk, mode) not in self.tree_verifiers:
                        self.tree_verifiers[(b, chunk, mode)] = capture_tree_verifier(
                            lambda run: self._record(run, self.stream), logits, chunk.shape, mode,
                            q if mode == "draft_probs" else None)

    def prepare_draft_loops(self, widths: Iterable[int], steps: Iterable[int]) -> None:
        """Capture the `draft_loop` graphs of every (bucket up to `sampling_batch_max`, width of
        step 1, steps, greedy or sampled) ahead of use, at start-up: captured on first use,
        a round would pay the capture (tens to hundreds of milliseconds, kernel compilation
        included) in the middle of a request."""
        for b in self.buckets:
            if b > self.sampling_batch_max:
                break
            for key in itertools.product([b], sorted(set(widths)), sorted(set(steps)), (True, False)):
                if key not in self.loops:
                    self.loops[key] = self._capture_loop(*key)

    @torch.inference_mode()
    def _capture_loop(self, b: int, w: int, steps: int, greedy: bool) -> _Loop:
        """Capture `steps` sampled (greedy: argmax) steps: step 1 reads the staged ids, each
        later step the tokens of the one before; step s reads its columns of the union's indices."""
        s, width = self.context_width, w + steps - 1
        segments = _loop_segments(b, w, steps, s)
        device = torch.zeros(sum(torch.Size(shape).numel() for _, shape in segments), dtype=torch.long,
                             device=self.device)
        parts = _split(device, b, w, s, segments)
        _capture_inputs(parts, width, self.pool.scratch_row)
        floats = torch.full((2 + steps, b), 0.5, dtype=torch.float64, device=self.device)
        floats[:2] = 1.0  # temperature 1, greedy
        write = parts["write_rows"].view(b, width)
        last = (torch.full((b,), w - 1, dtype=torch.long, device=self.device),
                torch.zeros(b, dtype=torch.long, device=self.device))

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            step_ids, tokens, probs = parts["ids"], [], []
            for i in range(steps):
                lo, hi = (0, w) if i == 0 else (w + i - 1, w + i)
                positions = parts["positions"][:, lo:hi].contiguous()  # [b, w_i]
                indices = ViewIndices(write[:, lo:hi].reshape(-1), parts["gather_rows"], positions,
                                      positions[:, -1] + 1)
                view = CacheView(self.pool.k_cache, self.pool.v_cache, indices)
                logits = self.model(step_ids, positions, view, logits_indices=last[min(i, 1)], kernels=self.kernels)
                if greedy:
                    new = greedy_tokens(logits)  # [b]
                else:
                    p = temperature_probs(logits, floats[0].float(), floats[1] > 0.5)  # [b, V]
                    new = sample_from_probs(p, floats[2 + i])  # [b]
                    if self.draft_probs:
                        probs.append(p)
                tokens.append(new)
                step_ids = new[:, None]
            return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)

        graph, (tokens, probs) = self._record(run, self.stream)
        g = _Loop(graph, _Staging(device), _Staging(floats), tokens, probs, last)
        for host in g.staging.hosts:
            host_parts = _split(host, b, w, s, segments)
            g.host_parts.append((host_parts["ids"], _host_indices(host_parts)))
        return g

    def _replay(self, g: _Graph, ids: torch.Tensor, layout: BatchLayout) -> None:
        n = len(layout.slots)
        g.staging.next_host()
        staged, indices = g.host_parts[g.staging.turn]
        self.pool.indices(layout, self.context_width, out=indices)  # padding rows write to scratch
        if not ids.is_cuda:
            staged["ids"][:n] = ids
        staged["last"][:n] = layout.last_token_indices("cpu")
        g.staging.send()
        if ids.is_cuda:  # tokens produced on the device by the previous step
            g.ids[:n].copy_(ids)
        g.graph.replay()
        if g.hidden is not None:
            assert self.model.capture is not None
            self.model.capture.last = g.hidden  # what the eager forward would have left
        self.pool.commit(layout)
        self.replays += 1
