"""Find the slow decode steps of adaptive speculation on the demo target: every step's wall
time over several generations, and for each step over --threshold ms what it was (K
chosen, catch-up seconds) and whether Python's garbage collector ran during it.

    PYTHONPATH=src python scripts/step_spikes.py [--runs 10] [--temperature 1] [--workload W1]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--workload", default="W1", choices=["W1", "W5"])
    ap.add_argument("--threshold", type=float, default=3.0, help="ms")
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024,
                use_speculative_decoding=True, spec_length=5, spec_policy="adaptive")
    collections: list[tuple[int, float]] = []  # (generation, seconds) of collections in a step
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(on_gc)
    for name, cfg in (("draft-adaptive", dict(base, draft_model=str(DEMO_DRAFT))),
                      ("ngram-adaptive", dict(base, speculative_method="ngram"))):
        engine = Engine(EngineConfig(**cfg))
        runner = engine.runner
        prompt = build_requests(WORKLOADS[args.workload], engine.vocab_size, engine.tokenizer).requests[0].prompt_ids
        chosen: list[int] = []
        choose = runner.policy.choose
        runner.policy.choose = lambda *a: (ks := choose(*a), chosen.append(max(ks)))[0]
        spikes, steps, total = [], 0, 0.0
        for run in range(args.runs + 1):
            engine.add_request(prompt, SamplingParams(temperature=args.temperature, max_tokens=256, ignore_eos=True,
                                                      seed=run))
            engine.step()  # prefill
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            while engine.has_unfinished():
                collections.clear()
                start = time.perf_counter()
                engine.step()
                ms = (time.perf_counter() - start) * 1e3
                if run == 0:
                    continue  # warm-up
                steps, total = steps + 1, total + ms
                if ms > args.threshold:
                    catch_up = getattr(runner.proposer, "catch_up_seconds", 0.0) * 1e3 if chosen[-1] else 0.0
                    gcs = ", ".join(f"gen{g} {s * 1e3:.1f} ms" for g, s in collections) or "no gc"
                    spikes.append(f"run {run} step {ms:.1f} ms: K={chosen[-1]}, catch-up {catch_up:.2f} ms, {gcs}")
        print(f"{name} {args.workload} T={args.temperature:g}: {steps} steps, mean {total / steps:.3f} ms, "
              f"{len(spikes)} over {args.threshold} ms", flush=True)
        for line in spikes:
            print("  " + line, flush=True)
        del engine, runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
