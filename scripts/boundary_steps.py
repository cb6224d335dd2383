"""Profile an adaptive engine's decode steps outside plain stretches that ran no round (the
"other" steps of `scripts/interleaved_ab.py --split`: the first steps after prefill, after
a batch change, when a probe or a cost refresh is due) against its stretch steps, on a
batch workload: their mean wall time by batch range (untimed generations), then a cProfile
of those steps alone (profiled generations; cProfile inflates Python-heavy code).

    PYTHONPATH=src python scripts/boundary_steps.py VARIANT [--temperature 1] [--workload W2]
        [--generations 4] [--min-batch 9] [--cpu-tiny]

Why: on the H100 (runs 22c-22d) such steps cost 100-800 us more than a stretch step at the same
batch size, ~20 a W2 generation: 1-2 % of the workload, half of what adaptive lost
against plain decoding there.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from interleaved_ab import build, one_workload_args
from plain_step_ab import submit_workload

from infer.bench.workloads import WORKLOADS, PromptSet, build_requests
from infer.engine.engine import Engine


def generation(engine: Engine, work: PromptSet, temperature: float, seed: int, min_batch: int,
               times: dict[str, list[float]] | None, profile: cProfile.Profile | None) -> None:
    """One run of the workload; steps at batch >= min_batch filed by kind into `times`, or the
    non-stretch steps profiled."""
    submit_workload(engine, work, temperature, seed)
    runner = engine.runner
    while engine.has_unfinished():
        stretch, batch, drafts = runner._stretch.active, len(engine.scheduler.running), runner.stats.drafts
        watched = batch >= min_batch
        if profile is not None and watched and not stretch:
            profile.enable()
            engine.step()
            profile.disable()
            continue
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if times is not None and watched:
            kind = "stretch" if stretch else "round" if runner.stats.drafts != drafts else "other"
            times[f"{kind} {'17-32' if batch > 16 else '9-16' if batch > 8 else '1-8'}"].append(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=4, help="timed, then as many profiled (2 warm up first)")
    ap.add_argument("--min-batch", type=int, default=9)
    args = one_workload_args(ap, "an adaptive variant of scripts/plain_step_ab.py, e.g. ngram-adaptive")
    with tempfile.TemporaryDirectory() as tmp:
        engine = build([args.variant], [args.workload], 0, args.cpu_tiny, Path(tmp))[args.variant]
        work = build_requests(WORKLOADS[args.workload], engine.vocab_size, engine.tokenizer)
        for g in range(2):
            generation(engine, work, args.temperature, 1000 * g, args.min_batch, None, None)
        times: dict[str, list[float]] = defaultdict(list)
        for g in range(args.generations):
            generation(engine, work, args.temperature, 10_000 + 100 * g, args.min_batch, times, None)
        for kind in sorted(times):
            ts = times[kind]
            print(f"{args.variant} {args.workload} T={args.temperature:g} {kind}: {len(ts) / args.generations:.1f} "
                  f"steps a generation, median {statistics.median(ts) * 1e6:.0f} us, mean "
                  f"{statistics.fmean(ts) * 1e6:.0f} us", flush=True)
        profile = cProfile.Profile()
        for g in range(args.generations):
            generation(engine, work, args.temperature, 20_000 + 100 * g, args.min_batch, None, profile)
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
