"""Every decode step of adaptive speculation on the demo pair (draft model, or n-gram with
`--method ngram`), by kind: plain steps (in a plain stretch, right after a round, or
else), probes (a round after plain steps) and rounds that continue speculation, with their
wall times, and what the cost model was fed (its plain samples by the kind of the step
before them). The plain engine's steps alongside.

    PYTHONPATH=src python scripts/step_log.py [--runs 8] [--temperature 0 1] [--workload W1 W5] [--method ngram]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    return f"n={len(v)} median {statistics.median(v):.3f} p90 {v[int(0.9 * (len(v) - 1))]:.3f} mean {statistics.mean(v):.3f}"


def log_steps(engine: Engine, prompt: list[int], temperature: float, runs: int) -> dict[str, list[float]]:
    runner = engine.runner
    stats = getattr(runner, "stats", None)
    observed: dict[str, list[float]] = defaultdict(list)
    costs = getattr(runner, "cost_model", None)
    kinds: dict[str, list[float]] = defaultdict(list)
    state = {"prev_round": False, "timing": False, "prev": "prefill"}
    if costs is not None:
        observe = costs.observe

        def logged(batch: int, k: int, seconds: float, sampled: bool = False) -> None:
            if state["timing"]:
                tag = "cost-model plain sample" if k == 0 else f"cost-model K={k} sample"
                if k == 0:
                    tag += f" (after {state['prev']})"
                observed[tag].append(seconds * 1e3)
            observe(batch, k, seconds, sampled)

        costs.observe = logged
    for run in range(runs + 1):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=256, ignore_eos=True, seed=run))
        engine.step()  # prefill
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        state["prev_round"] = False
        state["timing"] = run > 0  # run 0 warms up
        while engine.has_unfinished():
            rounds = stats.rounds if stats is not None else 0
            drafted = stats.draft_tokens if stats is not None else 0
            stretch = getattr(getattr(runner, "_stretch", None), "active", False)
            start = time.perf_counter()
            engine.step()
            ms = (time.perf_counter() - start) * 1e3
            k = (stats.draft_tokens - drafted) if stats is not None else 0
            is_round = stats is not None and stats.rounds > rounds and k > 0
            if is_round:
                kind = f"{'round' if state['prev_round'] else 'probe'} K={k}"
            else:
                kind = ("plain in a stretch" if stretch else "plain after a round" if state["prev_round"]
                        else "plain")
            if run > 0:
                kinds[kind].append(ms)
            state["prev_round"] = is_round
            state["prev"] = "a round" if is_round else "a stretch step" if stretch else "a plain step"
    return {**kinds, **observed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--workload", nargs="+", default=["W1"], choices=["W1", "W5"])
    ap.add_argument("--method", choices=["draft", "ngram"], default="draft")
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024)
    method = dict(draft_model=str(DEMO_DRAFT)) if args.method == "draft" else dict(speculative_method="ngram")
    configs = {"plain": EngineConfig(**base),
               f"{args.method}-adaptive": EngineConfig(**base, use_speculative_decoding=True, spec_length=5,
                                                       spec_policy="adaptive", **method)}
    engines = {}
    for name, config in configs.items():
        start = time.perf_counter()
        engines[name] = Engine(config)
        print(f"{name}: engine built in {time.perf_counter() - start:.2f} s", flush=True)
    for workload in args.workload:
        for t in args.temperature:
            for name, engine in engines.items():
                prompt = build_requests(WORKLOADS[workload], engine.vocab_size,
                                        engine.tokenizer).requests[0].prompt_ids
                kinds = log_steps(engine, prompt, t, args.runs)
                total = sum(sum(v) for key, v in kinds.items() if not key.startswith("cost-model"))
                print(f"{workload} T={t:g} {name}: {total / args.runs:.2f} ms a generation", flush=True)
                for kind in sorted(kinds):
                    print(f"  {kind:40s} {_summary(kinds[kind])}", flush=True)


if __name__ == "__main__":
    main()
