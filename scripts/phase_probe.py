"""Per-call timings of the rare, costly parts of speculation on the GPU machine: the draft's
catch-up prefill (tokens behind -> milliseconds, each call synchronised) and verification
(the fused forward + rejection sampling, and the whole `_verify` with its host work), at
T=0 and T=1.

    PYTHONPATH=src python scripts/phase_probe.py
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(obj: object, attr: str, log: list, describe=None) -> None:  # noqa: ANN001
    fn = getattr(obj, attr)

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        what = describe(*args) if describe else None
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        log.append((what, (time.perf_counter() - start) * 1e3))
        return out

    setattr(obj, attr, wrapper)


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: none"
    v = sorted(values)
    return (f"{name}: n={len(v)} median {statistics.median(v):.3f} ms, p90 {v[int(0.9 * (len(v) - 1))]:.3f}, "
            f"max {v[-1]:.3f}, first {values[0]:.3f}")


def generate(engine: Engine, prompt: list[int], temperature: float, tokens: int) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=4, max_seq_len=1024)
    # 1. draft catch-up: fixed K, so every round drafts; prompts of several lengths (lazy prefill)
    draft = Engine(EngineConfig(**base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT), spec_length=5))
    log: list = []
    runner = draft.runner
    timed(runner.draft, "_catch_up", log,
          lambda reqs: [r.num_computed_tokens - runner.draft.pool.seq_len(runner.draft._slot(r)) for r in reqs])
    for n in (100, 128, 200, 300, 100, 128, 200, 300, 57, 77):
        generate(draft, list(range(100, 100 + n)), 0.0, 8)
    for behind, ms in log:
        print(f"catch-up behind={behind}: {ms:.2f} ms", flush=True)
    # 2. verification at T=0 and T=1 with n-gram drafts on a repetitive prompt
    ngram = Engine(EngineConfig(**base, use_speculative_decoding=True, speculative_method="ngram", spec_length=5))
    r = ngram.runner
    phases: dict[str, list] = defaultdict(list)
    timed(r.forward, "verify", phases["forward+rejection sampling"])  # the fused path (graphs)
    timed(r, "_verify", phases["verify"])
    timed(r.proposer, "propose", phases["propose"])
    prompt = [100 + (i % 37) for i in range(300)]
    for t in (0.0, 1.0):
        for name in phases:
            phases[name].clear()
        for _ in range(3):
            generate(ngram, prompt, t, 200)
        for name, entries in phases.items():
            print(f"T={t:g} " + summary(name, [ms for _, ms in entries]), flush=True)


if __name__ == "__main__":
    main()
