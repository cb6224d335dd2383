"""Same-process A/B on the demo target: the plain ContinuousRunner against the
SpeculativeRunner that never speculates (K0: the runner's own cost), the adaptive policy
(n-gram with and without shadow drafts, draft model), fixed K=5, and plain decoding with
the sampling done eagerly after the decode graph or with index tensors built afresh every
step (both as before), on the bench's W1 and W5 prompts. Each round runs every engine
once, starting at a different engine and in reverse order every other round, so machine
drift hits all alike; "paired" is the median of per-round ratios to plain, "best" the
ratio of the fastest runs.

With `--instances N` every variant is built N times (plain included) and each round runs
every instance: identical engines in one process were seen to differ by 3-6 %, so one
instance per variant confounds the variant with its instance. The pooled ratio divides the
mean time of plain's instances in a round by each of the variant's; per-instance ratios (plain's
own instances among them: the method's noise floor) are printed too. `--gpu-time` also
times each engine's graph replays with CUDA events in one extra generation, to tell GPU
time from host time, and `--split` splits each decode step's host time (scheduler, the
runner's step, the plain decode inside it, retirement).

    PYTHONPATH=src python scripts/plain_step_ab.py [--rounds 15] [--temperature 0 1]
        [--workload W1 W5] [--variants ...] [--instances 1] [--gpu-time] [--split] [--gc-freeze] [--phases]
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, PromptSet, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


BATCH_WORKLOADS = ("W2", "W2-prefix")  # every request added at once, the whole workload timed


class NeverSpeculate:
    def choose(self, requests, seq_lens, max_seq_len, tokens_left):  # noqa: ANN001, ANN201
        return [0] * len(requests)

    def update(self, request_id, num_draft, num_accepted):  # noqa: ANN001, ANN201
        return None

    def no_proposal(self, request_id):  # noqa: ANN001, ANN201
        return None

    def release(self, request_id):  # noqa: ANN001, ANN201
        return None


def time_calls(obj: object, attr: str, record: Callable[[float, object], None],
               undo: list[tuple[object, str, object]]) -> None:
    """Hide obj.attr behind an instance attribute that passes each call's seconds and
    result to `record`; `undo` gets (obj, attr, the instance attribute it hid or None) for
    `restore`."""
    fn = getattr(obj, attr)
    prior = vars(obj).get(attr)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record(time.perf_counter() - start, out)
        return out

    setattr(obj, attr, wrapper)
    undo.append((obj, attr, prior))


def restore(undo: list[tuple[object, str, object]]) -> None:
    """Take `time_calls`' wrappers away again, latest first (an instance attribute a wrapper
    hid, such as a bound hook, comes back)."""
    for obj, attr, prior in reversed(undo):
        if prior is None:
            delattr(obj, attr)
        else:
            setattr(obj, attr, prior)
    undo.clear()


def step_parts(runner: object) -> list[tuple[object, str, str]]:
    """(object, method, label) of the parts of a speculative runner's decode step that the
    instruments time: the policy's choice and misses, the proposer, verification and
    acceptance, the cost model's bookkeeping, shadow drafts."""
    parts = [(runner.policy, "choose", "choose"), (runner.policy, "no_proposal", "miss"),
             (runner.proposer, "propose", "propose"), (runner, "_verify", "verify"), (runner, "_accept", "accept"),
             (runner.cost_model, "observe", "observe")]
    if runner.shadow is not None:
        parts += [(runner.shadow, "take", "shadow take"), (runner.shadow, "check", "shadow check")]
    if runner._keep_up is not None:  # n-gram tables: built or caught up (under forwards, or whole)
        parts += [(runner, "_keep_up", "keep up")]
    if runner.draft is not None:  # a draft model's round: its catch-up and its draft steps apart
        parts += [(runner.draft, "_catch_up", "catch-up"), (runner.draft, "_draft_loop", "draft loop")]
    if hasattr(runner.forward, "verify"):  # verification's graphs (forward and acceptance) within `verify`
        parts.append((runner.forward, "verify", "verify graphs"))
    return parts


def instrument(engine: Engine) -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Time the parts of each decode step of a speculative runner: policy, proposer, plain
    decode, verification, cost model; and count chosen K. Returns the timings and a
    function that removes the wrappers."""
    runner = engine.runner
    phases: dict[str, list[float]] = defaultdict(list)
    undo: list[tuple[object, str, object]] = []

    def timed(obj: object, attr: str, label: str) -> None:
        def record(seconds: float, out: object) -> None:
            phases[label].append(seconds)
            if label == "choose":
                phases[f"k={max(out)}"].append(0.0)  # type: ignore[call-overload]

        time_calls(obj, attr, record, undo)

    for obj, attr, label in step_parts(runner):
        timed(obj, attr, label)
    timed(runner, "_decode", "decode step")  # (until a plain stretch takes `_decode` over)

    def remove() -> None:
        restore(undo)

    return phases, remove


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def submit_workload(engine: Engine, work: PromptSet, temperature: float, seed: int = 0) -> None:
    """Add every request of a batch workload to `engine` (request i seeded `seed + i`)."""
    for i, job in enumerate(work.requests):
        engine.add_request(job.prompt_ids, SamplingParams(temperature=temperature, max_tokens=job.max_tokens,
                                                          ignore_eos=True, seed=seed + i))


def ms_per_token(engine: Engine, prompt: list[int] | PromptSet, temperature: float, tokens: int) -> float:
    """Decode milliseconds a token of one generation of `prompt` (its prefill apart), or of a
    whole batch workload (a PromptSet, W2: every request added at once, each with its own
    length; prefills and all included, milliseconds per output token)."""
    if isinstance(prompt, PromptSet):
        submit_workload(engine, prompt, temperature)
        sync()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync()
        return (time.perf_counter() - start) / prompt.expected_output_tokens * 1e3
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    engine.add_request(prompt, params)
    engine.step()  # prefill
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return (time.perf_counter() - start) / (tokens - 1) * 1e3


VARIANTS = ("plain", "plain-eager-sampling", "plain-fresh-indices", "ngram-K0", "ngram-k5", "ngram-adaptive", "ngram-adaptive-noshadow",
            "ngram-adaptive-nowatch", "ngram-adaptive-nocal", "draft-adaptive-nocal",
            "ngram-adaptive-nobatch", "draft-adaptive-nobatch",
            "draft-K0", "draft-k5", "draft-adaptive", "ngram-adaptive-K0", "draft-adaptive-K0", "ngram-adaptive-prior1",
            "plain-specforward", "draft-K0-plainforward", "draft-k5-steps", "draft-adaptive-plainpath",
            "draft-adaptive-plaindecode", "draft-adaptive-plainreserve", "ngram-adaptive-nokeep",
            "draft-adaptive-nokeep", "ngram-adaptive-hiddenbuilds", "ngram-adaptive-alltables",
            "ngram-adaptive-max16", "ngram-adaptive-noborrow", "draft-adaptive-noborrow", "ngram-adaptive-nopause",
            "ngram-adaptive-noriders", "ngram-adaptive-nolearnedstart", "ngram-adaptive-realizedrate",
            "ngram-adaptive-asplain", "ngram-adaptive-asplain-dict", "draft-adaptive-asplain", "late-plain",
            "draft-adaptive-notime", "draft-adaptive-plainstep", "draft-adaptive-plainrelease",
            "ngram-adaptive-noledger", "draft-adaptive-noledger", "ngram-adaptive-locked", "draft-adaptive-locked")


def fresh_indices(engine: Engine) -> None:
    """Index tensors built afresh every step and then copied into the graph's staging buffer,
    rows expanded from the block table every time (as before rows were kept per slot and
    indices filled in place)."""
    from infer.cache.view import layout_indices
    pool = engine.runner.cache_pool
    size = pool.block_size

    def rows(slot, start, end):  # noqa: ANN001, ANN202
        first = start // size
        blocks = torch.tensor(pool.block_table(slot)[first:-(-end // size)], dtype=torch.long)
        pos = torch.arange(start, end) - first * size
        return blocks[pos // size] * size + pos % size

    def indices(layout, context_width=None, out=None):  # noqa: ANN001, ANN202
        fresh = layout_indices(layout, rows, pool.scratch_row, context_width)
        if out is None:
            return fresh
        n = len(layout.slots)
        out.write_rows.fill_(pool.scratch_row)
        out.write_rows[:n * layout.width] = fresh.write_rows
        out.gather_rows[:n] = fresh.gather_rows
        out.q_pos[:n] = fresh.q_pos
        out.ctx_end[:n] = fresh.ctx_end
        return out

    pool.indices = indices


def eager_sampling(engine: Engine) -> None:
    """Plain decode steps sample eagerly after the forward (as before sampling was captured in
    the decode step's graph): the logits, then `logits_to_probs` and `sample_from_probs`."""
    runner = engine.runner

    def decode(requests):  # noqa: ANN001, ANN202
        from infer.cache.view import BatchLayout
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [1] * len(requests))
        logits = runner.forward(torch.tensor([[r.last_token_id] for r in requests]), layout, all_logits=False)
        for r in requests:
            r.num_computed_tokens += 1
        tokens = runner.sample(requests, logits)
        return [(r, runner.output.append(r, t)) for r, t in zip(requests, tokens, strict=True)]

    runner._decode = decode


def build_engines(variants: tuple[str, ...] = VARIANTS, instances: int = 1, max_batch_size: int = 1) -> dict[str, Engine]:
    """Engines by name; with instances > 1 each variant is built that many times, named
    "variant#i", in rotated order (instance i of every variant, then the next instance)."""
    if instances == 1:
        return _build(variants, max_batch_size)
    engines: dict[str, Engine] = {}
    for i in range(instances):
        engines.update({f"{name}#{i}": e for name, e in _build(variants, max_batch_size).items()})
    return engines


def _build(variants: tuple[str, ...], max_batch_size: int = 1, **engine_options: object) -> dict[str, Engine]:
    # (engine_options may replace the defaults: scripts/interleaved_ab.py's CPU stand-in passes
    # its own model, and as `draft_model` the draft variants')
    options = dict(engine_options)
    draft_path = options.pop("draft_model", DEMO_DRAFT)
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=max_batch_size, max_seq_len=1024) | options
    ngram = dict(base, use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    draft = dict(base, use_speculative_decoding=True, draft_model=str(draft_path), spec_length=5)
    configs = {"plain": base, "plain-eager-sampling": base, "plain-fresh-indices": base, "ngram-K0": ngram, "ngram-k5": ngram,
               "ngram-adaptive": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-noshadow": dict(ngram, spec_policy="adaptive"),
               # misses are never watched (a sampled request then waits the longest backoff)
               "ngram-adaptive-nowatch": dict(ngram, spec_policy="adaptive"),
               # rounds priced as measured: no episode calibration (spec/episodes.py)
               "ngram-adaptive-nocal": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-nocal": dict(draft, spec_policy="adaptive"),
               # each request decides as if a round were its own (no batch economics)
               "ngram-adaptive-nobatch": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-nobatch": dict(draft, spec_policy="adaptive"),
               # a request leaving ends the standing all-plain decision (a full choose follows)
               "ngram-adaptive-nokeep": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-nokeep": dict(draft, spec_policy="adaptive"),
               "ngram-adaptive-prior1": dict(ngram, spec_policy="adaptive"),
               # table builds never counted as upkeep, as before 5c064d3 (the GPU's work taken to hide them)
               "ngram-adaptive-hiddenbuilds": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-alltables": dict(ngram, spec_policy="adaptive"),
               # rounds priced out above batch 16 (no rounds, shadows or tables there): do they lose?
               "ngram-adaptive-max16": dict(ngram, spec_policy="adaptive"),
               # a batch size without a measured round priced by calibration, not its neighbour's
               "ngram-adaptive-noborrow": dict(ngram, spec_policy="adaptive"),
               # shadows never paused where no speculation started (`shadow_patience` 0)
               "ngram-adaptive-nopause": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-noriders": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-nolearnedstart": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-realizedrate": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-noborrow": dict(draft, spec_policy="adaptive"),
               # no loss ledger (spec/loss_ledger.py): exploring never locked out, as before
               "ngram-adaptive-noledger": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-noledger": dict(draft, spec_policy="adaptive"),
               # every key locked by the loss ledger from the start: what the runner costs
               # when it explores nothing
               "ngram-adaptive-locked": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-locked": dict(draft, spec_policy="adaptive"),
               # the forward functions swapped: which one carries the speculative engine's plain-step cost?
               "plain-specforward": base, "draft-K0-plainforward": draft,
               "draft-k5-steps": draft,  # draft rounds step by step (not one draft_loop replay)
               "draft-K0": draft, "draft-k5": draft, "draft-adaptive": dict(draft, spec_policy="adaptive"),
               # built (and calibrated) as adaptive, then never speculating: the build apart from the policy
               "ngram-adaptive-K0": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-K0": dict(draft, spec_policy="adaptive"),
               # built as adaptive, then decoding and reserving exactly as the plain runner does:
               # what the speculative engine costs apart from its code path (memory placement?)
               "draft-adaptive-plainpath": dict(draft, spec_policy="adaptive"),
               # half of that: the plain decode step with the speculative reservation, or the
               # speculative runner's decode with plain's reservation
               "draft-adaptive-plaindecode": dict(draft, spec_policy="adaptive"),
               "draft-adaptive-plainreserve": dict(draft, spec_policy="adaptive"),
               # built as adaptive, then its runner's class made the plain runner's: the instance
               # (its memory, its graphs, its build order) without a line of speculative code
               "ngram-adaptive-asplain": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-asplain": dict(draft, spec_policy="adaptive"),
               # ... with the plain runner's methods as instance attributes too (as plain stretches
               # had them until the twenty-third pass): what the instance dict alone costs
               "ngram-adaptive-asplain-dict": dict(ngram, spec_policy="adaptive"),
               # bisecting what a plain stretch's steps cost beyond the plain engine's: no step of
               # a stretch timed; the plain runner's `step` too in stretches (no pending gaps);
               # a finish releasing only what it must (no standing decision kept, no episode)
               "draft-adaptive-notime": dict(draft, spec_policy="adaptive"),
               "draft-adaptive-plainstep": dict(draft, spec_policy="adaptive"),
               "draft-adaptive-plainrelease": dict(draft, spec_policy="adaptive"),
               # a plain engine built after the variants listed before it (build order alone)
               "late-plain": base}
    engines = {name: Engine(EngineConfig(**configs[name])) for name in ("plain", *variants) if name in configs}
    if "draft-k5-steps" in engines:
        engines["draft-k5-steps"].runner.draft.fuse_rounds = False
    if "plain-specforward" in engines:  # a plain runner decoding through a speculative runner's graphs
        from infer.engine.speculative_runner import SpeculativeRunner
        runner = engines["plain-specforward"].runner
        runner.forward = SpeculativeRunner._make_decode_forward(runner)  # (reads config and model only)
    if "draft-K0-plainforward" in engines:  # the opposite: a speculative runner with plain graphs only
        from infer.engine.runner import ContinuousRunner
        runner = engines["draft-K0-plainforward"].runner
        runner.forward = ContinuousRunner._make_decode_forward(runner)
    for name in ("ngram-K0", "draft-K0", "ngram-adaptive-K0", "draft-adaptive-K0", "draft-K0-plainforward"):
        if name in engines:
            engines[name].runner.policy, engines[name].runner.shadow = NeverSpeculate(), None
    plain_parts = {"draft-adaptive-plainpath": ("_decode", "decode_demand", "ensure_capacity"),
                   "draft-adaptive-plaindecode": ("_decode",),
                   "draft-adaptive-plainreserve": ("decode_demand", "ensure_capacity")}
    for name, attrs in plain_parts.items():
        if name in engines:
            from infer.engine.runner import ContinuousRunner
            runner = engines[name].runner
            for attr in attrs:
                setattr(runner, attr, getattr(ContinuousRunner, attr).__get__(runner))
            if "_decode" not in attrs:  # plain's reservation cannot hold a round: never speculate
                choose = runner.policy.choose
                runner.policy.choose = lambda *a, _c=choose: [0] * len(_c(*a))
    for name in ("ngram-adaptive-asplain", "ngram-adaptive-asplain-dict", "draft-adaptive-asplain"):
        if name in engines:
            from infer.engine.runner import ContinuousRunner
            engines[name].runner.__class__ = ContinuousRunner
            if name.endswith("-dict"):
                for attr in ("decode_demand", "ensure_capacity", "_decode", "_in_flight"):
                    setattr(engines[name].runner, attr, getattr(ContinuousRunner, attr).__get__(engines[name].runner))
    if "draft-adaptive-notime" in engines:
        engines["draft-adaptive-notime"].runner._stretch.on_timed = None
    if "draft-adaptive-plainstep" in engines:
        from infer.engine.plain_stretch import PLAIN_METHODS
        engines["draft-adaptive-plainstep"].runner._stretch.methods = (*PLAIN_METHODS, "step")
    if "draft-adaptive-plainrelease" in engines:
        from infer.engine.runner import ContinuousRunner
        lean = engines["draft-adaptive-plainrelease"].runner

        def lean_release(request: object, runner: object = lean) -> None:
            runner.proposer.release(request)
            if request.is_finished:
                runner.policy.release(request.request_id)
            ContinuousRunner.release(runner, request)

        lean.release = lean_release
    if "plain-eager-sampling" in engines:
        eager_sampling(engines["plain-eager-sampling"])
    if "plain-fresh-indices" in engines:
        fresh_indices(engines["plain-fresh-indices"])
    if "ngram-adaptive-noshadow" in engines:
        noshadow = engines["ngram-adaptive-noshadow"].runner
        noshadow.shadow, noshadow.policy.shadowed = None, False
        noshadow._stretch.each_step = noshadow._stretch.after_step = None
    if "ngram-adaptive-alltables" in engines:  # every request's table, as before `table_pays`
        alltables = engines["ngram-adaptive-alltables"].runner
        alltables.policy.table_pays = lambda *args: True
        alltables.policy = alltables.policy  # (the runner binds the policy's hooks when it is set)
    if "ngram-adaptive-nopause" in engines:
        engines["ngram-adaptive-nopause"].runner.policy.shadow_patience = 0
    if "ngram-adaptive-noriders" in engines:  # rounds draft only for the requests that chose to
        engines["ngram-adaptive-noriders"].runner.policy.riders = False
    if "ngram-adaptive-nolearnedstart" in engines:  # a request without evidence waits for its first shadow
        engines["ngram-adaptive-nolearnedstart"].runner.policy.learned_start = False
    if "ngram-adaptive-realizedrate" in engines:  # tables priced at the batch's realized episode rate
        engines["ngram-adaptive-realizedrate"].runner.policy.table_by_realized = True
    if "ngram-adaptive-max16" in engines:
        max16 = engines["ngram-adaptive-max16"].runner.policy
        max16._cost_table = lambda batch_size, sampled=False, _t=max16._cost_table: (
            t if (t := _t(batch_size, sampled)) is None or batch_size <= 16 else t._replace(
                costs=[1.0] + [100.0] * (len(t.costs) - 1), probe_round=100.0, budget=1e-9, could_pay=0))
        max16.worth_shadowing = lambda batch_size, sampled, _w=max16.worth_shadowing: batch_size <= 16 and _w(
            batch_size, sampled)
        engines["ngram-adaptive-max16"].runner.policy = max16  # (binds the policy's hooks again)
    for name in ("ngram-adaptive-noborrow", "draft-adaptive-noborrow"):
        if name in engines:
            engines[name].runner.cost_model._neighbour_rounds = lambda batch_size, sampled: {}
    for name in ("ngram-adaptive-nobatch", "draft-adaptive-nobatch"):
        if name in engines:
            engines[name].runner.policy.batch_economics = False
    for name in ("ngram-adaptive-nokeep", "draft-adaptive-nokeep"):
        if name in engines:
            engines[name].runner._keep_quiet_without = None
    for name in ("ngram-adaptive-nocal", "draft-adaptive-nocal"):
        if name in engines:
            engines[name].runner.policy.calibration = None
    for name in ("ngram-adaptive-noledger", "draft-adaptive-noledger"):
        if name in engines:
            engines[name].runner.policy.ledger = None
    for name in ("ngram-adaptive-locked", "draft-adaptive-locked"):
        if name in engines:
            ledger = engines[name].runner.policy.ledger
            ledger._locked_until = {(1 << b, sampled): 1 << 60 for b in range(12) for sampled in (False, True)}
    if "ngram-adaptive-nowatch" in engines:
        engines["ngram-adaptive-nowatch"].runner.shadow.watch = lambda request_id: None
    if "ngram-adaptive-hiddenbuilds" in engines:
        runner = engines["ngram-adaptive-hiddenbuilds"].runner
        runner._build_tables = lambda requests, _b=runner._build_tables: (
            None if (built := _b(requests)) is None else (built[0], 0.0))
    if "ngram-adaptive-prior1" in engines:  # shadow evidence is free: a light prior
        engines["ngram-adaptive-prior1"].runner.policy.prior_weight = 1.0
    return engines


# the runner methods through which a speculative runner decodes, reserves and admits exactly
# as the plain ContinuousRunner does
# `_in_flight` and `_prefill_in_flight` too: the speculative ones take shadow drafts and
# build n-gram tables, which plain decoding must not pay (nor keep: plain `release` drops none)
PLAIN_METHODS = ("can_admit", "allocate", "ensure_capacity", "decode_demand", "_decode", "_in_flight",
                 "_prefill_in_flight", "release")


class plain_mode:  # noqa: N801 (a context manager used like a function)
    """Within `with plain_mode(engine):` a speculative engine decodes through the plain
    runner's methods on its own objects (model, cache, graphs): plain decoding with this
    instance's placement, so a ratio to it carries no instance effect."""

    def __init__(self, engine: Engine) -> None:
        self.runner = engine.runner

    def __enter__(self) -> None:
        from infer.engine.runner import ContinuousRunner
        for attr in PLAIN_METHODS:
            setattr(self.runner, attr, getattr(ContinuousRunner, attr).__get__(self.runner))

    def __exit__(self, *exc: object) -> None:
        for attr in PLAIN_METHODS:
            delattr(self.runner, attr)  # the instance attribute hid the class's method


def variant(name: str) -> str:
    return name.split("#")[0]


def with_policy(name: str) -> bool:
    """Whether an engine decodes through the adaptive policy (the self-paired and ledger
    instruments run for these)."""
    return variant(name).endswith(("adaptive", "nowatch", "nocal", "nobatch", "nokeep", "hiddenbuilds", "noshadow", "alltables",
                                      "max16", "noborrow", "nopause", "noriders", "nolearnedstart",
                                      "realizedrate", "noledger", "locked"))


def self_paired(name: str) -> bool:
    """Whether `--self-paired` runs an engine in its own plain mode too: the adaptive ones,
    and the speculative engines built to never speculate or to decode plainly in part
    (what they cost apart from the policy's choices)."""
    return with_policy(name) or variant(name).endswith(("K0", "plainpath", "plaindecode", "plainreserve"))


def gpu_timed(spans: list, fn: Callable, *args: object, **kwargs: object) -> object:
    """fn(*args, **kwargs) between two CUDA events, appended to `spans` as (begin, end): the
    GPU span of the work it queued (read with `elapsed_time` once that work is done)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    out = fn(*args, **kwargs)
    end.record()
    spans.append((begin, end))
    return out


class _TimedGraph:
    """A CUDA graph whose replays are timed with events (GPU time of the replay alone)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, spans: list) -> None:  # noqa: ANN001
        self.graph, self.spans = graph, spans

    def replay(self) -> None:
        gpu_timed(self.spans, self.graph.replay)


def step_split_us(engine: Engine, prompt: list[int], temperature: float, tokens: int) -> dict[str, float]:
    """One generation with each decode step's host time split (median us): the scheduler, the
    runner's step, the ContinuousRunner decode inside it (the forward's wait included), the
    retirement. The runner's step minus its inner decode is what the runner adds around it."""
    from infer.engine.runner import ContinuousRunner
    parts: dict[str, list[float]] = defaultdict(list)
    inner_decode = ContinuousRunner._decode

    def decode(self, requests):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = inner_decode(self, requests)
        parts["decode"].append(time.perf_counter() - start)
        return out

    def step():  # noqa: ANN202
        a = time.perf_counter()
        decision = engine.scheduler.schedule(engine.runner)
        b = time.perf_counter()
        results = engine.runner.step(decision.prefill, decision.decode)
        c = time.perf_counter()
        for request in engine.scheduler.retire(engine.runner):
            engine._requests.pop(request.request_id, None)
        if decision.decode and not decision.prefill:
            parts["schedule"].append(b - a)
            parts["runner step"].append(c - b)
            parts["retire"].append(time.perf_counter() - c)
        return results

    gc_start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            parts[f"gc{info['generation']}"].append(time.perf_counter() - gc_start.pop())

    ContinuousRunner._decode, engine.step = decode, step
    gc.callbacks.append(on_gc)
    try:
        ms_per_token(engine, prompt, temperature, tokens)
    finally:
        gc.callbacks.remove(on_gc)
        ContinuousRunner._decode = inner_decode
        del engine.step
    out = {k: statistics.median(v) * 1e6 for k, v in parts.items() if not k.startswith("gc")}
    steps = sorted(parts["runner step"])
    out["runner step mean"] = statistics.fmean(steps) * 1e6
    out["p90"] = steps[int(0.9 * (len(steps) - 1))] * 1e6
    out["max"] = steps[-1] * 1e6
    for k in sorted(x for x in parts if x.startswith("gc")):  # collections: count x total us
        out[f"{k} n"], out[f"{k} total"] = len(parts[k]), sum(parts[k]) * 1e6
    return out


def step_ledger(engine: Engine, prompt: list[int] | PromptSet, temperature: float, tokens: int,
                generations: int) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Generations with every decode step's wall time (schedule, runner step, retirement)
    filed under what the step did: "round" (verified drafts; "round, first" when the step
    before was no round: a probe, or a switch back to speculation), "choose" (the policy's full
    choice, then no drafts), "stretch" (a plain stretch step), "shadow take" (a shadow draft
    was taken), "shadow pending" (a shadow draft awaited its tokens), "quiet" (the rest).
    A plain runner's steps (or a runner in plain mode) are all "plain". Returns category ->
    [steps, tokens, seconds], and category -> part -> seconds: the inner plain decode step
    (forward, sampling, output), the policy's `choose`, the proposer, shadow takes and
    checks, the cost model's bookkeeping. A batch workload (W2) files its prefill steps too
    ("prefill", alone or beside a round or plain decode) and its decode steps by the batch's
    bucket ("round @32")."""
    from infer.engine.runner import ContinuousRunner
    runner = engine.runner
    by_batch = isinstance(prompt, PromptSet)
    calls = {"propose": 0, "choose": 0, "_verify": 0, "no_proposal": 0}
    spent: dict[str, float] = defaultdict(float)  # this step's timed parts
    undo: list[tuple[object, str, object]] = []

    def wrap(obj: object, attr: str, label: str) -> None:
        def record(seconds: float, out: object) -> None:
            if attr in calls:
                calls[attr] += 1
            spent[label] += seconds

        time_calls(obj, attr, record, undo)

    speculative = hasattr(runner, "_stretch") and "_decode" not in vars(runner)  # not in plain mode
    if speculative:
        for obj, attr, label in step_parts(runner):
            wrap(obj, attr, label)
    inner = ContinuousRunner._decode  # the plain decode step (stretches bind it when they start)

    def decode(self, requests):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        out = inner(self, requests)
        spent["inner decode"] += time.perf_counter() - start
        return out

    ContinuousRunner._decode = decode
    if "_decode" in vars(runner):  # plain mode: bound before
        runner._decode = decode.__get__(runner)
    ledger: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    previous = ["prefill"]  # the category of the step before
    gc_began: list[float] = []

    def on_gc(phase: str, info: dict) -> None:  # the collector's pauses, filed with the step's parts
        if phase == "start":
            gc_began.append(time.perf_counter())
        elif gc_began:
            spent[f"gc{info['generation']}"] += time.perf_counter() - gc_began.pop()

    gc.callbacks.append(on_gc)
    forward = runner.forward
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # the step's forwards (CUDA events)
    if torch.cuda.is_available():
        runner.forward = _TimedForward(forward, spans)

    def step():  # noqa: ANN202
        stretch = speculative and runner._stretch.active
        pending = speculative and runner.shadow is not None and len(runner.shadow) > 0
        why = _why_asked(runner.policy, previous[0]) if speculative and not stretch else ""
        before = dict(calls)
        spent.clear()
        a = time.perf_counter()
        decision = engine.scheduler.schedule(runner)
        results = runner.step(decision.prefill, decision.decode)
        for request in engine.scheduler.retire(runner):
            engine._requests.pop(request.request_id, None)
        seconds = time.perf_counter() - a
        for begin, end in spans:  # (the step has read its tokens: its GPU work is done)
            spent["gpu"] += begin.elapsed_time(end) / 1e3
        spans.clear()
        did = {k: calls[k] > before[k] for k in calls}
        cat = None
        if decision.prefill:
            previous[0] = "prefill"
            if by_batch:  # W2: prefill steps too, alone or beside decode steps (round or plain)
                cat = ("prefill" if not decision.decode else "prefill + round" if did["_verify"]
                       else "prefill + plain")
        if decision.decode and not decision.prefill:
            cat = ("plain" if not speculative else "round" if did["_verify"] else "choose" if did["choose"]
                   else "stretch" if stretch else "shadow take" if did["propose"] else "shadow pending" if pending
                   else "quiet")
            after_round, previous[0] = previous[0] == "round", cat
            if cat == "round" and not after_round:  # the first round after plain steps (a probe, a switch)
                cat = "round, first"
            if cat == "choose":  # split by why the policy was asked (`_why_asked`), or a miss
                cat = "choose: miss" if did["no_proposal"] else f"choose: {why}"
            if by_batch:  # W2: by the batch's bucket too (a plain step's cost grows with it)
                cat = f"{cat} @{1 << (len(decision.decode) - 1).bit_length()}"
        if cat is not None:
            entry = ledger[cat]
            entry[0] += 1
            entry[1] += len(results)
            entry[2] += seconds
            for label, x in spent.items():
                parts[cat][label] += x
        return results

    engine.step = step
    try:
        for _ in range(generations):
            ms_per_token(engine, prompt, temperature, tokens)
    finally:
        runner.forward = forward
        del engine.step
        ContinuousRunner._decode = inner
        if "_decode" in vars(runner):
            runner._decode = inner.__get__(runner)
        restore(undo)
        gc.callbacks.remove(on_gc)
    return ledger, parts


class _TimedForward:
    """A runner's forward functions with CUDA events around each call (`sample`, `verify`,
    the call itself): the span from the call's first launch to its last work, on the GPU."""

    def __init__(self, forward: object, spans: list) -> None:
        self._forward, self._spans = forward, spans

    def __call__(self, *args: object, **kwargs: object) -> object:
        return gpu_timed(self._spans, self._forward, *args, **kwargs)

    def sample(self, *args: object, **kwargs: object) -> object:
        return gpu_timed(self._spans, self._forward.sample, *args, **kwargs)

    def verify(self, *args: object, **kwargs: object) -> object:
        return gpu_timed(self._spans, self._forward.verify, *args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._forward, name)


def _why_asked(policy: object, previous: str) -> str:
    """Why a step outside a plain stretch asks the adaptive policy (read before the step): no
    standing all-plain decision (named by the step before: a round's evidence, a shadow
    draft's, a new request), or one that expired (a probe, a miss's backoff or a cost
    refresh due) or was priced before a cost measurement."""
    quiet = getattr(policy, "_quiet", None)
    if quiet is None:
        return f"none, after {previous}"
    if policy._steps + 1 >= quiet.until:  # type: ignore[attr-defined]
        return "expired"
    return "new costs" if quiet.version != policy.costs.version else "batch"  # type: ignore[attr-defined]


def print_ledger(engines: dict[str, Engine], prompt: list[int] | PromptSet, w: str, t: float, tokens: int,
                 generations: int) -> None:
    """Each adaptive instance's step ledger against its own plain mode (alternating, one
    generation each): per category, steps, tokens, us a step, and the excess, what those
    steps cost beyond the plain-mode time of their tokens, in % of the plain-mode total;
    then the timed parts of its steps (us a step of the category)."""
    for name, engine in engines.items():
        if not with_policy(name):
            continue
        ours: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        plain: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        our_parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        plain_parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for i in range(generations):
            for mode in ((False, True) if i % 2 else (True, False)):
                if mode:
                    with plain_mode(engine):
                        part, split = step_ledger(engine, prompt, t, tokens, 1)
                else:
                    part, split = step_ledger(engine, prompt, t, tokens, 1)
                for cat, (n, k, sec) in part.items():
                    entry = (plain if mode else ours)[cat]
                    entry[0] += n
                    entry[1] += k
                    entry[2] += sec
                    for label, x in split[cat].items():
                        (plain_parts if mode else our_parts)[cat][label] += x
        s_p = sum(sec for _, _, sec in plain.values())  # plain mode's whole time
        decode = [v for cat, v in plain.items() if cat.startswith("plain")]
        n_p, k_p = sum(v[0] for v in decode), sum(v[1] for v in decode)
        total = sum(sec for _, _, sec in ours.values())
        inner = sum(split["inner decode"] for cat, split in plain_parts.items() if cat.startswith("plain"))
        print(f"{w} T={t:g} {name} ledger over {generations} generations: plain mode "
              f"{sum(v[2] for v in decode) / n_p * 1e6:.1f} us a decode step (inner decode {inner / n_p * 1e6:.1f}); "
              f"adaptive / plain-mode time x{total / s_p:.4f}", flush=True)

        def per_token(cat: str) -> float:
            """Plain mode's seconds a token at the category's bucket (all its decode steps' if none)."""
            n, k, sec = plain.get("plain" + cat[cat.index(" @"):] if " @" in cat else "plain", (0, 0, 0.0))
            return sec / k if k else sum(v[2] for v in decode) / k_p

        for cat, (n, k, sec) in sorted(ours.items(), key=lambda kv: -kv[1][2]):
            print(f"    {cat:>30}: {n:6d} steps {k:6d} tokens {sec / n * 1e6:8.1f} us a step, "
                  f"excess {(sec - k * per_token(cat)) / s_p * 100:+.2f} %; parts (us a step) "
                  + ", ".join(f"{label} {x / n * 1e6:.1f}" for label, x in sorted(our_parts[cat].items())), flush=True)
        if isinstance(prompt, PromptSet):  # plain mode's own ledger (its prefill steps, its buckets)
            for cat, (n, k, sec) in sorted(plain.items(), key=lambda kv: -kv[1][2]):
                print(f"    plain mode {cat:>19}: {n:6d} steps {k:6d} tokens {sec / n * 1e6:8.1f} us a step, "
                      f"{sec / s_p * 100:5.1f} % of its time; parts (us a step) "
                      + ", ".join(f"{label} {x / n * 1e6:.1f}" for label, x in sorted(plain_parts[cat].items())),
                      flush=True)


def graph_gpu_ms(engine: Engine, prompt: list[int], temperature: float, tokens: int) -> tuple[float, float, int]:
    """One generation with every replay of the target's decode graphs timed: (median GPU ms
    of a replay, wall ms per token, replays timed)."""
    forward = engine.runner.forward
    graphs = list(getattr(forward, "graphs", {}).values()) + list(getattr(forward, "samplers", {}).values())
    spans: list = []
    for g in graphs:
        g.graph = _TimedGraph(g.graph, spans)
    try:
        wall = ms_per_token(engine, prompt, temperature, tokens)
    finally:
        for g in graphs:
            g.graph = g.graph.graph
    sync()
    times = [s.elapsed_time(e) for s, e in spans]
    return (statistics.median(times) if times else float("nan")), wall, len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--workload", nargs="+", default=["W1", "W5"], choices=["W1", "W5", *BATCH_WORKLOADS],
                    help="W2 (and W2-prefix, its prompts sharing a 256-token prefix): 32 requests at once, timed "
                         "whole (needs --max-batch-size 32; the per-step instruments --phases --split --gpu-time "
                         "are for W1 and W5; --ledger files W2's prefill steps too, and its decode steps by batch "
                         "bucket)")
    ap.add_argument("--max-batch-size", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="engines to compare (plain is always there)")
    ap.add_argument("--phases", action="store_true", help="also time the phases of adaptive steps (extra runs)")
    ap.add_argument("--instances", type=int, default=1, help="engines built per variant (see the docstring)")
    ap.add_argument("--gpu-time", action="store_true", help="also time graph replays with CUDA events")
    ap.add_argument("--split", action="store_true", help="also split decode steps' host time (extra runs)")
    ap.add_argument("--self-paired", action="store_true",
                    help="each round also runs every adaptive instance in plain mode (its own objects, the plain "
                         "runner's methods) and prints its ratio to that: the adaptive overhead without instance effects")
    ap.add_argument("--ledger", type=int, default=0, metavar="N",
                    help="also file N generations' decode steps of each adaptive instance by what they did, "
                         "against as many of its plain mode (extra runs)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after building the engines (collections skip their objects)")
    args = ap.parse_args()
    batched = [w for w in args.workload if w in BATCH_WORKLOADS]
    if batched and (args.phases or args.split or args.gpu_time):
        ap.error(f"--phases, --split and --gpu-time time one request's steps: leave {', '.join(batched)} out for them")
    for w in batched:
        if args.max_batch_size < WORKLOADS[w].num_requests:
            ap.error(f"{w} runs {WORKLOADS[w].num_requests} requests at once: pass --max-batch-size "
                     f"{WORKLOADS[w].num_requests}")
    engines = build_engines(tuple(args.variants), args.instances, args.max_batch_size)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
        print(f"gc.freeze(): {gc.get_freeze_count()} objects frozen", flush=True)
    names = list(engines)
    plain = engines[names[0]]
    for w in args.workload:
        work = build_requests(WORKLOADS[w], plain.vocab_size, plain.tokenizer)
        prompt = work if w in BATCH_WORKLOADS else work.requests[0].prompt_ids
        for t in args.temperature:
            times: dict[str, list[float]] = {name: [] for name in engines}
            own_plain: dict[str, list[float]] = {name: [] for name in engines if args.self_paired
                                                 and self_paired(name)}
            for engine in engines.values():
                ms_per_token(engine, prompt, t, args.tokens)  # warm-up
            before = {name: copy.deepcopy(e.runner.stats) for name, e in engines.items() if hasattr(e.runner, "stats")}
            for i in range(args.rounds):
                # rotated, and reversed every other round: no variant always follows the same one
                # (the engine run right after another was seen to pay for it, up to 5 %)
                rotated = names[i % len(names):] + names[:i % len(names)]
                for name in rotated if i % 2 == 0 else rotated[::-1]:
                    # the same instance decoding plainly, right before it every other round and
                    # right after it otherwise (the order alternates: a run right after another differs)
                    if name in own_plain and i % 2:
                        with plain_mode(engines[name]):
                            own_plain[name].append(ms_per_token(engines[name], prompt, t, args.tokens))
                    times[name].append(ms_per_token(engines[name], prompt, t, args.tokens))
                    if name in own_plain and not i % 2:
                        with plain_mode(engines[name]):
                            own_plain[name].append(ms_per_token(engines[name], prompt, t, args.tokens))
            if args.instances > 1:
                print_pooled(times, w, t)
            if own_plain:
                print_self_paired(times, own_plain, w, t)
            ref_name = names[0]
            ref, best_ref = statistics.median(times[ref_name]), min(times[ref_name])
            for name, ts in times.items():
                med = statistics.median(ts)
                # the median of per-round ratios cancels drift of the machine between rounds
                paired = statistics.median(p / x for p, x in zip(times[ref_name], ts, strict=True))
                print(f"{w} T={t:g} {name}: {med:.3f} ms/token (x{ref / med:.3f} of plain speed; paired x{paired:.3f}, "
                      f"best x{best_ref / min(ts):.3f}), runs " + " ".join(f"{x:.3f}" for x in ts), flush=True)
            for name, earlier in before.items():  # what the timed runs did, per generation
                d = engines[name].runner.stats.minus(earlier)
                print(f"{w} T={t:g} {name} per generation: {d.drafts / args.rounds:.1f} rounds, "
                      f"{d.draft_tokens / args.rounds:.1f} drafted, {d.accepted_tokens / args.rounds:.1f} accepted",
                      flush=True)
            if args.phases:
                print_phases(engines, prompt, w, t, args.tokens)
            if args.ledger:
                print_ledger(engines, prompt, w, t, args.tokens, args.ledger)
            if args.gpu_time and torch.cuda.is_available():
                for name, engine in engines.items():
                    gpu, wall, n = graph_gpu_ms(engine, prompt, t, args.tokens)
                    print(f"{w} T={t:g} {name} graph replay: median {gpu:.4f} ms GPU over {n} replays, "
                          f"{wall:.3f} ms/token wall", flush=True)
            if args.split:
                for name, engine in engines.items():
                    split = step_split_us(engine, prompt, t, args.tokens)
                    print(f"{w} T={t:g} {name} host split (median us): "
                          + ", ".join(f"{k} {v:.1f}" for k, v in split.items()), flush=True)
            for name, engine in engines.items():
                if with_policy(name) or variant(name).endswith("prior1"):
                    for b in ((32, 16, 8, 4, 2, 1) if w in BATCH_WORKLOADS else (1,)):
                        if engine.runner.cost_model.has_plain(b, t > 0):
                            print_costs(f"{w} T={t:g} {name}", engine, t > 0, b)


def print_pooled(times: dict[str, list[float]], w: str, t: float) -> None:
    """Ratios to plain with every variant's instances pooled: the median, over rounds and the
    variant's instances, of plain's mean time in that round / the instance's time (a slow
    run of one instance moves one ratio, not a whole round's). Then each instance's own
    paired ratio to pooled plain (plain's instances show the noise floor of the method)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in times:
        groups[variant(name)].append(name)
    rounds = len(next(iter(times.values())))

    def mean_at(members: list[str], i: int) -> float:
        return statistics.fmean(times[m][i] for m in members)

    plain = [mean_at(groups["plain"], i) for i in range(rounds)]
    for v, members in groups.items():
        pooled = statistics.median(plain[i] / times[m][i] for m in members for i in range(rounds))
        each = [statistics.median(plain[i] / times[m][i] for i in range(rounds)) for m in members]
        low, high = pooled_interval(times, groups["plain"], members)
        print(f"{w} T={t:g} {v} pooled over {len(members)} instances: paired x{pooled:.3f} "
              f"(95% interval x{low:.3f}-x{high:.3f}); instances " + " ".join(f"x{x:.3f}" for x in each), flush=True)


def print_self_paired(times: dict[str, list[float]], own_plain: dict[str, list[float]], w: str, t: float) -> None:
    """Each adaptive instance against itself in plain mode, run right before or after it in
    the same round: the median over rounds and instances of plain-mode time / adaptive
    time, with a 95 % bootstrap interval."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in own_plain:
        groups[variant(name)].append(name)
    for v, members in groups.items():
        ratios = {m: [p / x for p, x in zip(own_plain[m], times[m], strict=True)] for m in members}
        pooled = statistics.median(r for m in members for r in ratios[m])
        low, high = bootstrap_interval(lambda gs, picked: statistics.median(
            ratios[m][i] for m in gs[0] for i in picked), [members], len(ratios[members[0]]))
        print(f"{w} T={t:g} {v} against its own plain mode over {len(members)} instances: x{pooled:.3f} "
              f"(95% interval x{low:.3f}-x{high:.3f}); instances "
              + " ".join(f"x{statistics.median(ratios[m]):.3f}" for m in members), flush=True)


def pooled_interval(times: dict[str, list[float]], plain: list[str], members: list[str]) -> tuple[float, float]:
    """A 95 % bootstrap interval of the pooled ratio (`print_pooled`), plain's instances
    resampled as well as the variant's."""
    return bootstrap_interval(lambda gs, picked: statistics.median(
        statistics.fmean(times[p][i] for p in gs[0]) / times[m][i] for m in gs[1] for i in picked),
        [plain, members], len(times[plain[0]]))


def bootstrap_interval(statistic: Callable[[list[list[str]], list[int]], float], groups: list[list[str]],
                       rounds: int, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of `statistic(groups, rounds)`, resampling both sources of
    noise, two-level: each group's instances with replacement (identical engines differ by
    a few %), then the rounds (machine drift)."""
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        drawn = [[rng.choice(g) for _ in g] for g in groups]
        values.append(statistic(drawn, [rng.randrange(rounds) for _ in range(rounds)]))
    values.sort()
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def print_costs(label: str, engine: Engine, sampled: bool, batch: int = 1) -> None:
    """What the adaptive policy believes at a batch size (W2: the full batch's bucket) in a
    sampling mode (`sampled`: T > 0): relative costs r(K), the episode calibration's kappa,
    one draft step, the calibrated forward's share of a real plain step, and the measured
    step times."""
    costs = engine.runner.cost_model
    b = costs.bucket(batch)
    plain = costs.step_seconds(batch, 0, sampled)
    c, v = costs.calibrated(batch)
    observed = {k: x for (bucket, k, mode), x in costs.observed.items() if bucket == b and mode == sampled}
    expired = {k: round(x * 1e3, 3) for k in range(1, costs.k_max + 1)
               if (x := costs._value(("step", (b, k, sampled)), expired=True)) is not None and k not in observed}
    calibration = engine.runner.policy.calibration
    kappa = calibration.factor((b, sampled)) if calibration is not None else None
    print(f"{label} costs (batch {batch}): r(K) {[round(x, 2) for x in costs.relative_costs(batch, sampled)]}, "
          f"kappa {kappa}, draft step {costs.draft_step(batch, sampled):.3f}, forward share "
          f"{costs._forward_share(batch, plain):.3f}, measured ms {dict(sorted((k, round(x * 1e3, 3)) for k, x in observed.items()))}, "
          f"expired ms {expired}, switch {costs.switch_cost(batch, sampled):.2f}, calibrated c {c:.3f} "
          f"v {[round(x, 2) for x in v]}", flush=True)


def print_phases(engines: dict[str, Engine], prompt: list[int], w: str, t: float, tokens: int) -> None:
    """Per-phase breakdown from extra, instrumented generations (the wrappers cost host time
    themselves, so the timed rounds run without them)."""
    for name, engine in engines.items():
        if not variant(name).endswith(("adaptive", "noshadow", "prior1")):
            continue
        phases, remove = instrument(engine)
        ms_per_token(engine, prompt, t, tokens)
        remove()
        print(f"{w} T={t:g} {name} per step (instrumented): " + ", ".join(
            f"{k} {statistics.fmean(v) * 1e3:.3f} ms x{len(v)}" for k, v in sorted(phases.items()) if v), flush=True)

if __name__ == "__main__":
    main()
