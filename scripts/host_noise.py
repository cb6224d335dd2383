"""How much a batch workload's wall time varies from generation to generation on this host,
and whether pinning the engine's process to one CPU core (and raising its priority) makes
it steadier: the plain engine on W2, generations run in turn under each setting.

    PYTHONPATH=src python scripts/host_noise.py [--generations 12] [--temperature 1] [--core 3]

Why: on the H100 hosts the demo target at batch 32 is bound by host work, and single
generations of the same engine read up to 45 % apart in one run (20d), more than the
effects the adaptive policy is judged on (3 %).
"""

from __future__ import annotations

import argparse
import os
import statistics

from infer.bench.workloads import WORKLOADS, build_requests
from plain_step_ab import _build, ms_per_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--workload", default="W2")
    ap.add_argument("--core", type=int, default=3)
    args = ap.parse_args()
    engine = _build((), WORKLOADS[args.workload].num_requests)["plain"]
    prompts = build_requests(WORKLOADS[args.workload], engine.vocab_size, engine.tokenizer)
    every = os.sched_getaffinity(0)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    settings = {"all cores": (every, nice), f"core {args.core}": ({args.core}, nice),
                f"core {args.core}, nice -15": ({args.core}, -15)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    ms_per_token(engine, prompts, args.temperature, 0)  # warm-up
    for g in range(args.generations):
        for name, (cores, priority) in settings.items():
            os.sched_setaffinity(0, cores)
            try:
                os.setpriority(os.PRIO_PROCESS, 0, priority)
            except PermissionError:
                pass
            times[name].append(ms_per_token(engine, prompts, args.temperature, 0))
    os.sched_setaffinity(0, every)
    for name, xs in times.items():
        med = statistics.median(xs)
        mad = statistics.median(abs(x - med) for x in xs)
        print(f"{name:>20}: ms/token min {min(xs):.4f} median {med:.4f} max {max(xs):.4f} "
              f"(max/min x{max(xs) / min(xs):.2f}, MAD {100 * mad / med:.1f} %); "
              + " ".join(f"{x:.4f}" for x in xs), flush=True)


if __name__ == "__main__":
    main()
