"""How much host work a plain decode step hides under its forward (GPU machine).

`ContinuousRunner._in_flight` runs after a step's forward is queued and before its tokens
are read; shadow drafts and n-gram table upkeep run there on the promise that they hide
under the forward. This spins the host for a fixed time in that hook and reports the step
time against no spin, on the demo target (W1 prompt, batch 1, CUDA graphs): a step that
grows by the whole spin hides nothing.

    PYTHONPATH=src python scripts/inflight_slack.py [--spins 0 10 20 40 80 160] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plain_step_ab import ms_per_token  # noqa: E402

from infer.bench.workloads import WORKLOADS, build_requests  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402
from infer.engine.loading import DEMO_TARGET  # noqa: E402
from infer.spec.ngram import NgramProposer  # noqa: E402


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spins", type=float, nargs="+", default=[0, 10, 20, 40, 80, 160])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--ngram", action="store_true", help="also n-gram table upkeep in the hook (see above)")
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024))
    runner = engine.runner
    prompt = build_requests(WORKLOADS["W1"], engine.vocab_size, engine.tokenizer).requests[0].prompt_ids
    for t in args.temperature:
        ms_per_token(engine, prompt, t, args.tokens)  # warm-up
        hooks = {f"spin {s:g} us": (lambda requests, _s=s: spin(_s)) if s else type(runner)._in_flight.__get__(runner)
                 for s in args.spins}
        if args.ngram:
            for every in (1, 8):
                proposer, count = NgramProposer(), [0]

                def upkeep(requests, _p=proposer, _n=count, _every=every):  # noqa: ANN001, ANN202
                    _n[0] += 1
                    if _n[0] % _every == 0:
                        _p.keep_up(requests)

                hooks[f"n-gram keep_up every {every}"] = upkeep
        times: dict[str, list[float]] = {name: [] for name in hooks}
        for i in range(args.rounds):
            order = list(hooks) if i % 2 == 0 else list(hooks)[::-1]
            for name in order:
                runner._in_flight = hooks[name]
                times[name].append(ms_per_token(engine, prompt, t, args.tokens))
        base = next(iter(times.values()))
        for name, ts in times.items():
            extra = statistics.median((x - b) * 1e3 for x, b in zip(ts, base, strict=True))
            print(f"T={t:g} {name:>24} in _in_flight: {statistics.median(ts) * 1e3:7.1f} us a token, "
                  f"paired extra {extra:+6.1f} us", flush=True)


if __name__ == "__main__":
    main()
