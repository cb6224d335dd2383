"""Same-process A/B of plain decode steps: the plain ContinuousRunner against the
SpeculativeRunner when it decides not to speculate (K = 0 every step) and with the adaptive
policy. Generations alternate between engines so machine drift hits all alike.

    PYTHONPATH=src python scripts/plain_step_ab.py [--rounds 5] [--temperature 0 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


class NeverSpeculate:
    def choose(self, requests, seq_lens, max_seq_len, tokens_left):  # noqa: ANN001, ANN201
        return [0] * len(requests)

    def update(self, request_id, num_draft, num_accepted):  # noqa: ANN001, ANN201
        return None

    def no_proposal(self, request_id):  # noqa: ANN001, ANN201
        return None

    def release(self, request_id):  # noqa: ANN001, ANN201
        return None


def instrument(engine: Engine) -> dict[str, list[float]]:
    """Time the parts of each decode step of a speculative runner: policy, proposer, plain
    decode, verification, cost model; and count chosen K."""
    runner = engine.runner
    phases: dict[str, list[float]] = defaultdict(list)

    def timed(obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[label].append(time.perf_counter() - start)
            if label == "choose":
                phases[f"k={max(out)}"].append(0.0)
            return out

        setattr(obj, attr, wrapper)

    timed(runner.policy, "choose", "choose")
    timed(runner.proposer, "propose", "propose")
    timed(runner, "_verify", "verify")
    timed(runner, "_accept", "accept")
    timed(runner.cost_model, "observe", "observe")
    timed(runner, "_speculative_decode", "decode step")
    return phases


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms_per_token(engine: Engine, temperature: float, tokens: int) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    engine.add_request(list(range(100, 228)), params)
    engine.step()  # prefill
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return (time.perf_counter() - start) / (tokens - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=512)
    ngram = dict(base, use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    draft = dict(base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT), spec_length=5)
    engines = {"plain": Engine(EngineConfig(**base)), "ngram-K0": Engine(EngineConfig(**ngram)),
               "ngram-adaptive": Engine(EngineConfig(**ngram, spec_policy="adaptive")),
               "draft-K0": Engine(EngineConfig(**draft)),
               "draft-adaptive": Engine(EngineConfig(**draft, spec_policy="adaptive"))}
    for name in ("ngram-K0", "draft-K0"):
        engines[name].runner.policy = NeverSpeculate()
    for t in args.temperature:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for name, engine in engines.items():
            ms_per_token(engine, t, args.tokens)  # warm-up
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(ms_per_token(engine, t, args.tokens))
        ref = statistics.median(times["plain"])
        for name, ts in times.items():
            med = statistics.median(ts)
            # each round's variant ran right after that round's plain run: the median of the
            # per-round ratios cancels drift of the machine between rounds
            paired = statistics.median(p / x for p, x in zip(times["plain"], ts, strict=True))
            print(f"T={t:g} {name}: {med:.3f} ms/token (x{ref / med:.3f} of plain speed; paired x{paired:.3f}), "
                  "runs " + " ".join(f"{x:.3f}" for x in ts), flush=True)
    # the per-phase breakdown comes from extra, instrumented generations (the wrappers cost
    # host time themselves, so the timed rounds above run without them)
    for name, engine in engines.items():
        if not name.endswith("adaptive"):
            continue
        phases = instrument(engine)
        for t in args.temperature:
            ms_per_token(engine, t, args.tokens)
            print(f"T={t:g} {name} per step (instrumented): " + ", ".join(
                f"{k} {statistics.fmean(v) * 1e3:.3f} ms x{len(v)}" for k, v in sorted(phases.items()) if v),
                flush=True)
            phases.clear()


if __name__ == "__main__":
    main()
