"""A/B with one engine per process: plain vs the speculative runner that never speculates
(K0), each timed in its own fresh process, processes alternating. Separates the runner's
own cost on plain steps from effects of several engines sharing one process (build order,
memory placement), which `plain_step_ab.py` cannot.

    PYTHONPATH=src python scripts/process_ab.py [--processes 4] [--runs 5] [--temperature 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def child(kind: str, temperature: float, runs: int, workload: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from plain_step_ab import NeverSpeculate, ms_per_token

    from infer.bench.workloads import WORKLOADS, build_requests
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.engine.loading import DEMO_TARGET
    cfg = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024)
    if kind != "plain":
        cfg.update(use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    engine = Engine(EngineConfig(**cfg))
    if kind != "plain":
        engine.runner.policy = NeverSpeculate()
    prompt = build_requests(WORKLOADS[workload], engine.vocab_size, engine.tokenizer).requests[0].prompt_ids
    ms_per_token(engine, prompt, temperature, 256)
    print(json.dumps([ms_per_token(engine, prompt, temperature, 256) for _ in range(runs)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=4, help="processes per kind")
    ap.add_argument("--runs", type=int, default=5, help="timed generations per process")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--workload", default="W1", choices=["W1", "W5"])
    ap.add_argument("--child", choices=["plain", "ngram-K0"])
    args = ap.parse_args()
    if args.child:
        child(args.child, args.temperature, args.runs, args.workload)
        return
    medians: dict[str, list[float]] = {"plain": [], "ngram-K0": []}
    for i in range(args.processes):
        for kind in (("plain", "ngram-K0") if i % 2 == 0 else ("ngram-K0", "plain")):
            out = subprocess.run([sys.executable, __file__, "--child", kind, "--runs", str(args.runs),
                                  "--temperature", str(args.temperature), "--workload", args.workload],
                                 check=True, capture_output=True, text=True).stdout
            runs = json.loads(out.strip().splitlines()[-1])
            medians[kind].append(statistics.median(runs))
            print(f"process {i} {kind}: median {medians[kind][-1]:.3f} ms/token, runs "
                  + " ".join(f"{x:.3f}" for x in runs), flush=True)
    paired = statistics.median(p / k for p, k in zip(medians["plain"], medians["ngram-K0"], strict=True))
    print(f"{args.workload} T={args.temperature:g}: ngram-K0 x{paired:.3f} of plain (median of per-pair ratios of "
          f"process medians); plain {statistics.median(medians['plain']):.3f}, "
          f"ngram-K0 {statistics.median(medians['ngram-K0']):.3f} ms/token", flush=True)


if __name__ == "__main__":
    main()
