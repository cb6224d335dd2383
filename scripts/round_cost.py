"""What one speculative round costs, by phase, when it comes every step and when it comes
after a stretch of plain steps (an adaptive policy's probe). Forced schedules of K on the
demo target with the demo draft or n-gram drafting, W1 prompt, batch 1:

    every   K drafts at every step (steady speculation)
    probe   K drafts once every --gap steps, plain steps in between

Per schedule and K: the wall time of rounds and of plain steps, and of a round's phases:
drafting (catch-up apart), verification, acceptance, all host-synchronised as the runner
is. Also the adaptive cost model's view: its relative cost r(K) from these measurements.

    PYTHONPATH=src python scripts/round_cost.py [--gap 40] [--ks 1 3 5] [--temperature 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plain_step_ab import NeverSpeculate, sync  # noqa: E402

from infer import SamplingParams  # noqa: E402
from infer.bench.workloads import WORKLOADS, build_requests  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from infer.spec.policy import guard_k  # noqa: E402


class Schedule(NeverSpeculate):
    """K at steps that are multiples of `gap` (every step when gap is 1), else 0."""

    def __init__(self, k: int, gap: int) -> None:
        self.k, self.gap, self.step = k, gap, 0

    def choose(self, requests, seq_lens, max_seq_len, tokens_left):  # noqa: ANN001, ANN201
        self.step += 1
        k = self.k if self.step % self.gap == 0 else 0
        return [guard_k(k, n, max_seq_len, left) for n, left in zip(seq_lens, tokens_left)]


def measure(engine: Engine, prompt: list[int], temperature: float, k: int, gap: int, tokens: int) -> dict:
    runner = engine.runner
    runner.policy = Schedule(k, gap)
    phases: dict[str, list[float]] = defaultdict(list)
    originals = {}

    def wrap(obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)
        originals[(id(obj), attr)] = (obj, attr)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[label].append(time.perf_counter() - start)
            return out

        setattr(obj, attr, timed)

    wrap(runner.proposer, "propose", "propose")
    wrap(runner, "_verify", "verify")
    wrap(runner, "_accept", "accept")
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    request = engine.add_request(prompt, params)
    engine.step()  # prefill
    sync()
    rounds, plains, catch_up = [], [], []
    while engine.has_unfinished():
        speculating = runner.policy.step + 1
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if speculating % gap == 0 and k:
            rounds.append(seconds)
            catch_up.append(runner.proposer.catch_up_seconds)
        else:
            plains.append(seconds)
    for obj, attr in originals.values():
        delattr(obj, attr)
    emitted = len(request.output_token_ids)
    med = statistics.median
    return {"round": med(rounds) if rounds else float("nan"), "plain": med(plains) if plains else float("nan"),
            "catch_up": med(catch_up) if catch_up else 0.0, "rounds": len(rounds), "emitted": emitted,
            **{p: med(v) for p, v in phases.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gap", type=int, default=40)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=["draft_model", "ngram"], choices=["draft_model", "ngram"])
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024,
                use_speculative_decoding=True, spec_length=max(args.ks))
    for method in args.methods:
        cfg = dict(base, draft_model=str(DEMO_DRAFT)) if method == "draft_model" else dict(base, speculative_method="ngram")
        engine = Engine(EngineConfig(**cfg))
        prompt = build_requests(WORKLOADS["W1"], engine.vocab_size, engine.tokenizer).requests[0].prompt_ids
        for t in args.temperature:
            measure(engine, prompt, t, max(args.ks), 1, args.tokens)  # warm-up
            measure(engine, prompt, t, 1, args.gap, args.tokens)
            for k in args.ks:
                for name, gap in (("every", 1), ("probe", args.gap)):
                    m = measure(engine, prompt, t, k, gap, args.tokens)
                    plain = m["plain"] if gap > 1 else float("nan")
                    print(f"{method} T={t:g} K={k} {name}: round {m['round'] * 1e3:.3f} ms (x{m['round'] / plain:.2f} "
                          f"of a plain step {plain * 1e3:.3f}) over {m['rounds']} rounds; propose "
                          f"{m.get('propose', 0) * 1e3:.3f} (catch-up {m['catch_up'] * 1e3:.3f}), verify "
                          f"{m.get('verify', 0) * 1e3:.3f}, accept {m.get('accept', 0) * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
