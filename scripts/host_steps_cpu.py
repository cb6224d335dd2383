"""A CPU stand-in for the GPU host's decode steps: a tiny random Llama (one layer, hidden 32)
whose forward costs about what the host's own work does, so a decode step on the dev CPU is
host-bound the way the demo target's steps are on the H100 at batch 16-32. Runs W2 (or
another batch workload) with an adaptive engine, generations alternating between its own
plain mode (`plain_step_ab.plain_mode`) and adaptive decoding, and compares their decode steps
by batch size: the median step of each, whether the adaptive step ran in a plain stretch, and
the excess (median difference x steps) per batch size, plus the totals.

    PYTHONPATH=src python scripts/host_steps_cpu.py [--temperature T] [--generations N]
        [--method ngram|prompt_lookup] [--workload W2]

Why: the GPU hosts' generation-to-generation noise (up to 20-45 %) hides the few-% host
costs issue #5 is about, and the GPU time is short. Twenty-first pass, dev CPU, W2 T=1, 12
generations each: stretch steps at batch 32 read p10 2095 us / median 2270 us against 2097 /
2259 in plain mode; the adaptive engine's non-stretch steps (after a batch change) 8-12 %
dearer, ~4 % of the steps at 32. No GPU effect (graph replays, the forward's GPU span) shows
here, and the dev CPU is noisy too: compare medians over many steps, not generations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers (the checkpoint writer)
from plain_step_ab import BATCH_WORKLOADS, plain_mode, submit_workload  # noqa: E402

from infer.bench.workloads import WORKLOADS, PromptSet, build_requests  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402

# (mode, batch size, in a plain stretch) -> seconds of each engine step
Steps = dict[tuple[str, int, bool], list[float]]


def tiny_checkpoint(directory: Path) -> Path:
    from tests.helpers.checkpoints import make_checkpoint
    return make_checkpoint(directory, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)


def generation(engine: Engine, work: PromptSet, temperature: float, mode: str, steps: Steps) -> None:
    """One run of the workload, every engine step filed under (mode, batch size, stretch)."""
    submit_workload(engine, work, temperature)
    runner, scheduler = engine.runner, engine.scheduler
    while engine.has_unfinished():
        key = (mode, len(scheduler.running), runner._stretch.active)
        start = time.perf_counter()
        engine.step()
        steps.setdefault(key, []).append(time.perf_counter() - start)


def report(steps: Steps) -> None:
    total = {mode: sum(sum(v) for (m, _, _), v in steps.items() if m == mode) for mode in ("plain", "adaptive")}
    print(f"total seconds: plain mode {total['plain']:.3f}, adaptive {total['adaptive']:.3f} "
          f"(adaptive / plain time x{total['adaptive'] / total['plain']:.3f})")
    print("batch | steps | plain median us | adaptive median us (stretch steps, others) | excess ms")
    for n in sorted({b for _, b, _ in steps}, reverse=True):
        plain = [x for (m, b, _), v in steps.items() if m == "plain" and b == n for x in v]
        stretch = steps.get(("adaptive", n, True), [])
        other = steps.get(("adaptive", n, False), [])
        if not plain or not (stretch or other):
            continue
        adaptive = stretch + other
        excess = (statistics.median(adaptive) - statistics.median(plain)) * len(adaptive) * 1e3
        print(f"{n:5d} | {len(plain):5d} | {statistics.median(plain) * 1e6:8.0f} | "
              f"{statistics.median(adaptive) * 1e6:8.0f} ({len(stretch)} in stretches"
              f"{f', median {statistics.median(stretch) * 1e6:.0f}' if stretch else ''}; {len(other)} others"
              f"{f', median {statistics.median(other) * 1e6:.0f}' if other else ''}) | {excess:+.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--generations", type=int, default=12, help="of each mode, alternating (2 more warm up)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "prompt_lookup"])
    ap.add_argument("--workload", default="W2", choices=BATCH_WORKLOADS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(EngineConfig(model=str(tiny_checkpoint(Path(tmp))), use_cuda_graphs=False,
                                     max_batch_size=WORKLOADS[args.workload].num_requests, max_seq_len=1024,
                                     use_speculative_decoding=True, speculative_method=args.method, spec_length=5,
                                     spec_policy="adaptive"))
        work = build_requests(WORKLOADS[args.workload], engine.vocab_size, None)
        for _ in range(2):
            generation(engine, work, args.temperature, "warm-up", {})
        steps: Steps = {}
        for _ in range(args.generations):
            with plain_mode(engine):
                generation(engine, work, args.temperature, "plain", steps)
            generation(engine, work, args.temperature, "adaptive", steps)
        print(f"{args.workload} T={args.temperature} {args.method}, {args.generations} generations each; "
              f"{engine.runner.stats}")
        report(steps)


if __name__ == "__main__":
    main()
