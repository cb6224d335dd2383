"""Where a decode step's host time goes: cProfile over whole generations on the demo target.

For each engine (plain; n-gram, draft model at fixed K; their adaptive policies) and each
temperature: one warm-up generation, then `--generations` under cProfile. Prints decode
steps and rounds, the wall time a token without and with the profiler, and the functions
of this project (and torch's Python layer) with the most time of their own and the most
time in all, per decode step, in microseconds. cProfile adds overhead to every Python call,
so compare engines with each other, not with unprofiled timings.

    PYTHONPATH=src python scripts/round_profile.py [--variants plain ngram-k5] [--temperature 0 1] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET

VARIANTS = ("plain", "ngram-k5", "ngram-adaptive", "draft-k5", "draft-adaptive")


def config(name: str, max_batch_size: int = 1) -> EngineConfig:
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=torch.cuda.is_available(), max_batch_size=max_batch_size,
                max_seq_len=1024)
    if name == "plain":
        return EngineConfig(**base)
    method, policy = name.split("-")
    spec = dict(use_speculative_decoding=True, spec_length=5,
                spec_policy="adaptive" if policy == "adaptive" else "fixed")
    if method == "ngram":
        return EngineConfig(**base, **spec, speculative_method="ngram")
    return EngineConfig(**base, **spec, draft_model=str(DEMO_DRAFT))


def generate(engine: Engine, prompts: list[list[int]], temperature: float, seed: int, tokens: list[int]) -> int:
    """One generation of every prompt at once; returns its engine steps after the first."""
    for i, (prompt, n) in enumerate(zip(prompts, tokens, strict=True)):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                                                  seed=seed * 1000 + i))
    engine.step()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--workload", default="W1", choices=["W1", "W5", "W2", "W2-prefix"],
                    help="W2 / W2-prefix: all 32 requests at once (batch 32, their own output lengths)")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    workload = WORKLOADS[args.workload]
    engines = {name: Engine(config(name, workload.num_requests)) for name in args.variants}
    for t in args.temperature:
        for name, engine in engines.items():
            specs = build_requests(workload, engine.vocab_size, engine.tokenizer).requests
            prompts = [s.prompt_ids for s in specs]
            tokens = [args.tokens] if workload.num_requests == 1 else [s.max_tokens for s in specs]
            emitted = args.generations * sum(n - 1 for n in tokens)
            generate(engine, prompts, t, 0, tokens)  # warm-up
            start = time.perf_counter()
            steps = sum(generate(engine, prompts, t, 1 + g, tokens) for g in range(args.generations))
            plain_wall = (time.perf_counter() - start) / emitted * 1e6
            stats = getattr(engine.runner, "stats", None)
            before = stats.drafts if stats is not None else 0
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            steps = sum(generate(engine, prompts, t, 1 + g, tokens) for g in range(args.generations))
            profile.disable()
            wall = (time.perf_counter() - start) / emitted * 1e6
            rounds = (stats.drafts - before) if stats is not None else 0
            print(f"\n== {args.workload} T={t:g} {name}: {steps / args.generations:.1f} decode steps and "
                  f"{rounds / args.generations:.1f} rounds a generation; {plain_wall:.1f} us/token "
                  f"({wall:.1f} profiled)", flush=True)
            table = pstats.Stats(profile).stats  # (file, line, fn) -> (cc, nc, tottime, cumtime, callers)
            rows = [(f"{key[0].split('/src/')[-1].split('site-packages/')[-1]}:{key[1]}({key[2]})", nc, tt, ct)
                    for key, (_, nc, tt, ct, _) in table.items()
                    if "round_profile.py" not in key[0] and key[2] != "<built-in method builtins.sum>"]
            per = 1e6 / steps
            for label, col in (("own time", 2), ("time in all", 3)):
                print(f"-- top by {label} (us a decode step; calls a step)")
                for row in sorted(rows, key=lambda r: -r[col])[:args.top]:
                    print(f"  {row[col] * per:8.2f}  {row[1] / steps:6.2f}  {row[0]}")


if __name__ == "__main__":
    main()
