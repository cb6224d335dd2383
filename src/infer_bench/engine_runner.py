"""Run a workload on our engine and measure it.

`run_engine` builds an Engine sized for the workload, warms it up at full length, then adds
every request at once and steps until all finish, bracketed by device synchronisation.
Reported: wall time, output tokens/s, per-request TTFT and decode tokens/s, and the delta
of the engine's speculation and prefix-cache counters over the timed part.
docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import copy
import gc
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from infer.engine.step_costs import weight_bytes
from infer.timing import synchronize
from infer_bench.workloads import PromptSet, RequestSpec, Workload, build_requests, random_ids
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import resolve_device
from infer.engine.request import Request
from infer.speculative.metrics import SpecStats

SEQ_LEN_QUANTUM = 128
SAVED_IDS = 64  # request 0's first output ids are kept: same weights + greedy -> comparable


def default_dtype(device: torch.device) -> str:
    return "bfloat16" if device.type == "cuda" else "float32"


def engine_config(workload: Workload, overrides: Mapping[str, Any], device: str = "auto") -> EngineConfig:
    """EngineConfig sized for the workload (batch = its requests, or its concurrency;
    max_seq_len = its longest request rounded up), then the variant's overrides."""
    dev = resolve_device(overrides.get("device", device))
    needed = workload.max_total_tokens + 16  # room for a speculation round at the end
    values: dict[str, Any] = dict(
        device=str(dev), dtype=default_dtype(dev), max_batch_size=workload.concurrency or workload.num_requests,
        max_seq_len=-(-needed // SEQ_LEN_QUANTUM) * SEQ_LEN_QUANTUM)
    values.update(overrides)
    return EngineConfig.from_kwargs(**values)


def spec_snapshot(engine: Engine) -> SpecStats | None:
    """A copy of the engine's speculation counters (None without speculation)."""
    stats = engine.runner.stats
    return copy.deepcopy(stats) if stats is not None else None


def spec_metrics(stats: SpecStats) -> dict[str, Any]:
    return {
        "spec_rounds": stats.rounds, "spec_drafting_rounds": stats.drafts, "spec_draft_tokens": stats.draft_tokens,
        "spec_accepted_tokens": stats.accepted_tokens, "spec_emitted_tokens": stats.emitted_tokens,
        "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
        "mean_k": stats.draft_tokens / stats.drafts if stats.drafts else 0.0,
        # accepted draft tokens per drafting round (a tree: the accepted path), by depth, by length
        "mean_accepted_path": stats.mean_accepted_path, "acceptance_by_depth": stats.acceptance_by_depth,
        "accepted_lengths": list(stats.accepted_lengths),
        "spec_followed_steps": stats.followed,  # (rounds in flight: docs/speculation.md)
    }


def _prefix_counters(engine: Engine) -> tuple[int, int] | None:
    pool = engine.runner.cache_pool
    if not hasattr(pool, "prefix_query_tokens"):
        return None
    return pool.prefix_query_tokens, pool.prefix_hit_tokens


def warmup(engine: Engine, workload: Workload, prompts: PromptSet, tokens: int | None) -> None:
    """Random prompts with the workload's lengths (output lengths capped at `tokens`; None =
    full length, so every context length the timed run meets was seen once: kernels that
    plan per shape, e.g. cuDNN attention, would otherwise pay that inside the timing).
    A shared prefix is kept, as a system prompt already served would be: the timed part
    then sees the steady-state prefix cache (requests admitted in one step cannot share
    blocks none of them has computed)."""
    if tokens == 0:
        return
    rng = random.Random(workload.seed + 7919)
    n_prefix = workload.shared_prefix_len
    for i, spec in enumerate(prompts.requests):
        ids = spec.prompt_ids[:n_prefix] + random_ids(rng, engine.vocab_size, len(spec.prompt_ids) - n_prefix)
        engine.add_request(ids, workload.sampling_params(10_000 + i, min(tokens or spec.max_tokens, spec.max_tokens)),
                           request_id=f"warmup-{i}")
    while engine.has_unfinished():
        engine.step()


class TimedRun(NamedTuple):
    requests: list[Request]
    wall: float  # seconds
    steps: int  # engine steps
    slowest_step: int  # the index of the step whose host call took longest (-1: no step)
    slowest_step_s: float  # ... and its seconds (a stall: a compile, a capture, a collection)


def timed_run(engine: Engine, workload: Workload, specs: Sequence[RequestSpec]) -> TimedRun:
    """Add every request, step to completion. The garbage collector is run first and what
    exists then frozen (`gc.freeze`) for the run: a full collection the run's objects trigger
    scans those alone, not the models, graphs and earlier runs' objects (a pause that would
    land inside one run of several)."""
    gc.collect()
    gc.freeze()
    try:
        synchronize(engine.device)
        start = time.perf_counter()
        requests = [engine.add_request(s.prompt_ids, workload.sampling_params(i, s.max_tokens),
                                       request_id=f"bench-{i}") for i, s in enumerate(specs)]
        steps, slowest, slowest_s = 0, -1, 0.0
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            if (took := time.perf_counter() - t) > slowest_s:
                slowest, slowest_s = steps, took
            steps += 1
        synchronize(engine.device)
        return TimedRun(requests, time.perf_counter() - start, steps, slowest, slowest_s)
    finally:
        gc.unfreeze()


def slowest_steps(runs: Sequence[TimedRun]) -> dict[str, list]:
    """Each run's slowest step, its index and milliseconds (where a run's outlier lands)."""
    return {"slowest_step_runs": [r.slowest_step for r in runs],
            "slowest_step_ms_runs": [r.slowest_step_s * 1e3 for r in runs]}


def request_metrics(requests: Sequence[Request], wall_s: float) -> dict[str, Any]:
    """Throughput and per-request latency numbers of one timed run."""
    out_tokens = sum(len(r.output_token_ids) for r in requests)
    ttft = [r.first_token_time - r.arrival_time for r in requests if r.first_token_time is not None]
    decode = [(len(r.output_token_ids) - 1) / (r.finish_time - r.first_token_time) for r in requests
              if r.finish_time is not None and r.first_token_time is not None and len(r.output_token_ids) > 1
              and r.finish_time > r.first_token_time]
    return {
        "first_output_ids": list(requests[0].output_token_ids[:SAVED_IDS]) if requests else [],
        "wall_s": wall_s, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_max_s": max(ttft) if ttft else None,
        "decode_tokens_per_s": statistics.fmean(decode) if decode else None,
        "decode_tokens_per_s_min": min(decode) if decode else None,
    }


def primary_rate(metrics: Mapping[str, Any], num_requests: int) -> float | None:
    """What a speedup compares: decode tokens/s at batch 1, throughput otherwise."""
    if num_requests == 1 and metrics.get("decode_tokens_per_s"):
        return metrics["decode_tokens_per_s"]
    return metrics.get("tokens_per_s")


def run_engine(workload: Workload, overrides: Mapping[str, Any], *, device: str = "auto",
               warmup_tokens: int | None = None, repeats: int = 1,
               paired_with: Mapping[str, Any] | None = None,
               paired_instances: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `workload` on an engine with `overrides`; returns (params, metrics).

    The timed run is repeated `repeats` times on the same engine (the same requests and
    seeds); the run with the median wall time gives the metrics, every wall time is kept,
    and the speculation / prefix counters cover all of them.

    `paired_with`: overrides of a baseline engine built alongside. Each round times both,
    the baseline first in even rounds and second in odd ones, so drift of the machine
    between rounds hits both alike; `paired_speedup` is the median over rounds of this
    engine's rate / the baseline's (a ratio of a few percent needs it: single runs of
    host-bound models drift more), and `paired_best_speedup` the ratio of the two best
    runs (spikes, which only ever slow a run down, drop out of both).

    `paired_instances` > 1 builds that many engines of each kind (identical engines in one
    process differ by a few percent, which a single pair confounds with what is compared):
    each round times them all, pairs alternating in order, and `paired_ratios` holds every
    instance's rate / the mean of the round's baseline rates, `paired_speedup` their
    median; `paired_instance_speedups` gives each instance's own median. The other metrics
    are the first instance's.
    """
    if paired_instances < 1:
        raise ValueError(f"paired_instances must be >= 1, got {paired_instances}")
    config = engine_config(workload, overrides, device)
    t0 = time.perf_counter()
    dev = resolve_device(config.device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    engine = Engine(config)
    load_s = time.perf_counter() - t0
    n = paired_instances if paired_with is not None else 1
    ours = [engine] + [Engine(config) for _ in range(n - 1)]
    bases = [Engine(engine_config(workload, paired_with, device)) for _ in range(n)] if paired_with is not None else []
    try:
        prompts = build_requests(workload, engine.vocab_size, engine.tokenizer)
        for e in bases + ours:
            warmup(e, workload, prompts, warmup_tokens)
        spec0, prefix0 = spec_snapshot(engine), _prefix_counters(engine)
        runs: list[list[TimedRun]] = [[] for _ in ours]  # [instance][round]
        base_runs: list[list[TimedRun]] = [[] for _ in bases]
        # a progress bar over the timed runs (on a terminal only; updated between runs, never inside one)
        with tqdm(total=repeats * n * (2 if bases else 1), desc=workload.name, unit="run", leave=False,
                  disable=None) as bar:
            for i in range(repeats):
                for j in range(n):
                    pair = [(ours[j], runs[j])] + ([(bases[j], base_runs[j])] if bases else [])
                    for e, out in pair if (i + j) % 2 else pair[::-1]:
                        e.reset_draft_history()  # (a repeat drafts from nothing the run before it left)
                        out.append(timed_run(e, workload, prompts.requests))
                        bar.update(1)
        median = sorted(runs[0], key=lambda run: run.wall)[len(runs[0]) // 2]
        requests, wall, steps = median.requests, median.wall, median.steps
        metrics = request_metrics(requests, wall)
        metrics.update(wall_s_runs=[r.wall for r in runs[0]], **slowest_steps(runs[0]))
        if bases:
            metrics.update(_paired_metrics(runs, base_runs, workload.num_requests))
        metrics.update(engine_counters(engine, spec0, prefix0))
        metrics.update(load_s=load_s, steps=steps, expected_output_tokens=prompts.expected_output_tokens,
                       weight_bytes=weight_bytes(engine.models.target),
                       draft_weight_bytes=weight_bytes(engine.models.draft) if engine.models.draft else None,
                       leaks=engine.leak_report())
        metrics["primary_rate"] = primary_rate(metrics, workload.num_requests)
        if dev.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        params = {"workload": workload.to_dict(), "prompt_source": prompts.source,
                  "engine": config_record(engine), "overrides": dict(overrides)}
        if paired_with is not None:
            params["paired_with"] = dict(paired_with)
        return params, metrics
    finally:
        for e in ours + bases:
            e.close()  # (tensor parallelism: its workers end now, not whenever it is collected)
        del engine, ours, bases
        free_memory()


def _paired_metrics(runs: list[list[TimedRun]], base_runs: list[list[TimedRun]],
                    num_requests: int) -> dict[str, Any]:
    """Paired ratios from [instance][round] runs of the measured engines and their baselines."""
    def rate(run: TimedRun) -> float | None:
        return primary_rate(request_metrics(run.requests, run.wall), num_requests)

    rounds = len(runs[0])
    ours = [[rate(r) for r in inst] for inst in runs]  # [instance][round]
    base = [[rate(r) for r in inst] for inst in base_runs]
    ratios, per_instance = [], []
    for inst in ours:
        mine = []
        for k in range(rounds):
            round_base = [b[k] for b in base if b[k]]
            if inst[k] and round_base:
                mine.append(inst[k] / statistics.fmean(round_base))
        ratios += mine
        per_instance.append(statistics.median(mine) if mine else None)
    best_ours = max(x for inst in ours for x in inst if x)
    best_base = max(x for inst in base for x in inst if x)
    out: dict[str, Any] = {"paired_ratios": ratios, "paired_speedup": statistics.median(ratios),
                           "paired_best_speedup": best_ours / best_base,
                           "paired_baseline_wall_s_runs": [r.wall for r in base_runs[0]]}
    if len(runs) > 1:
        out["paired_instance_speedups"] = per_instance
    return out


def engine_counters(engine: Engine, spec0: SpecStats | None,
                    prefix0: tuple[int, int] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    spec1 = spec_snapshot(engine)
    if spec0 is not None and spec1 is not None:
        out.update(spec_metrics(spec1.minus(spec0)))
    prefix1 = _prefix_counters(engine)
    if prefix0 is not None and prefix1 is not None:
        queried, hit = prefix1[0] - prefix0[0], prefix1[1] - prefix0[1]
        out.update(prefix_query_tokens=queried, prefix_hit_tokens=hit,
                   prefix_hit_rate=hit / queried if queried else None)
    replays = getattr(engine.runner.forward, "replays", None)
    if replays is not None:
        out["graph_replays"] = replays
    return out


def config_record(engine: Engine) -> dict[str, Any]:
    """The engine's config fields, with the values it decided for those left to the device
    and the model (CUDA graphs, the sizes)."""
    config, resolved = engine.config, engine.resolved
    return {**{f.name: getattr(config, f.name) for f in fields(config)},
            "use_cuda_graphs": resolved.execution.use_cuda_graphs, "max_batch_size": resolved.scheduler.max_batch_size,
            "max_seq_len": resolved.scheduler.max_seq_len, "num_blocks": resolved.cache.num_blocks}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
