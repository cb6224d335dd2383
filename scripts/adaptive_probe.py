"""Diagnose the adaptive speculation policy on the GPU: per-step wall time, chosen k,
the cost model's calibrated and observed costs. PYTHONPATH=src python scripts/adaptive_probe.py"""

from __future__ import annotations

import time
from collections import Counter

import torch

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine


def run(policy: str, model: str | None, draft: str | None, steps_log: bool) -> None:
    cfg = EngineConfig(model=model, draft_model=draft, use_speculative_decoding=True, spec_length=5,
                       spec_policy=policy, use_cuda_graphs=True, max_batch_size=1, max_seq_len=512,
                       load_format="dummy" if model and model.startswith("dummy") else "auto")
    e = Engine(cfg)
    r = e.runner
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    for rep in range(2):
        req = e.add_request(list(range(100, 228)), params)
        e.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        times, ks = [], Counter()
        while e.has_unfinished():
            s = time.perf_counter()
            before = len(req.output_token_ids)
            e.step()
            times.append((time.perf_counter() - s) * 1e3)
            ks[len(req.output_token_ids) - before] += 1
        dt = time.perf_counter() - t0
        times.sort()
        print(f"{policy} {model} rep{rep}: {255 / dt:.0f} tok/s; step ms p50 {times[len(times) // 2]:.2f} "
              f"p90 {times[int(len(times) * .9)]:.2f} max {times[-1]:.1f}; tokens/step {dict(ks)}", flush=True)
    print("  calibrated", r.cost_model.calibrated(1), flush=True)
    print("  observed ms", {k: round(v * 1e3, 3) for k, v in r.cost_model.observed.items()}, flush=True)
    print("  relative", [round(x, 2) for x in r.cost_model.relative_costs(1)], flush=True)


if __name__ == "__main__":
    for model, draft in [(None, None), ("dummy:llama-3.2-3b", "dummy:llama-3.2-1b")]:
        for policy in ("fixed", "adaptive"):
            run(policy, model, draft, False)
        del model
        torch.cuda.empty_cache()
