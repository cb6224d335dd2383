"""Why does the speculative runner cost more than the plain one on steps where it does not
speculate? Same-process: engines built in a mixed order (to separate build order from
runner kind), per-token wall time over rotated rounds, then each engine's GPU kernel time
per decode step from torch.profiler.

    PYTHONPATH=src python scripts/k0_probe.py [--rounds 11] [--workload W5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from plain_step_ab import NeverSpeculate, ms_per_token  # noqa: E402

from infer import SamplingParams  # noqa: E402
from infer.bench.workloads import WORKLOADS, build_requests  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--workload", default="W5", choices=["W1", "W5"])
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024)
    ngram = dict(base, use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    draft = dict(base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT), spec_length=5)
    order = [("ngram-K0 (built 1st)", ngram), ("plain", base), ("draft-K0", draft),
             ("ngram-K0 (built 4th)", ngram), ("plain (built 5th)", base)]
    engines = {}
    for name, cfg in order:
        engines[name] = Engine(EngineConfig(**cfg))
        if "K0" in name:
            engines[name].runner.policy = NeverSpeculate()
    names = list(engines)
    first = engines["plain"]
    prompt = build_requests(WORKLOADS[args.workload], first.vocab_size, first.tokenizer).requests[0].prompt_ids
    times: dict[str, list[float]] = {n: [] for n in names}
    for e in engines.values():
        ms_per_token(e, prompt, 0.0, args.tokens)
    for i in range(args.rounds):
        for n in names[i % len(names):] + names[:i % len(names)]:
            times[n].append(ms_per_token(engines[n], prompt, 0.0, args.tokens))
    ref = times["plain"]
    for n, ts in times.items():
        paired = statistics.median(p / x for p, x in zip(ref, ts, strict=True))
        print(f"{args.workload} T=0 {n}: {statistics.median(ts):.3f} ms/token, paired x{paired:.3f} of plain", flush=True)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for n, e in engines.items():
        e.add_request(prompt, params)
        e.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while e.has_unfinished():
                e.step()
            torch.cuda.synchronize()
        rows = sorted((k for k in prof.key_averages() if k.device_time_total > 0),
                      key=lambda k: -k.self_device_time_total)
        total = sum(k.self_device_time_total for k in rows) / 63
        print(f"{n}: GPU {total:.1f} us per step; top: " + "; ".join(
            f"{k.key[:60]} {k.self_device_time_total / 63:.1f}us x{k.count / 63:.1f}" for k in rows[:6]), flush=True)


if __name__ == "__main__":
    main()
