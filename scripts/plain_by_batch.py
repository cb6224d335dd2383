"""A plain decode step's wall time against the batch size, on the demo target: the shape
that `CostModel.plain_at` assumes (a line between the buckets' measured points, each
bucket's median standing for its median measured batch size) checked against a direct
measurement. For each temperature and batch size: that many requests of one prompt are
added, prefilled, then `--steps` decode steps are timed one by one (each ends in a host
sync: its tokens are on the host); prints the median and quartiles in milliseconds, and
the line `plain_at` would draw from the powers of two alone.

    PYTHONPATH=src python scripts/plain_by_batch.py [--sizes 1 2 4 ...] [--steps 48]
"""

from __future__ import annotations

import argparse
import statistics
import time

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_TARGET
from infer.spec.costs import CostModel
from plain_step_ab import sync


def step_ms(engine: Engine, batch: int, temperature: float, steps: int, prompt_len: int) -> list[float]:
    """Wall milliseconds of `steps` plain decode steps at `batch` requests (after prefill)."""
    prompt = [(7 * i) % 1000 + 3 for i in range(prompt_len)]
    for i in range(batch):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=steps + 8, ignore_eos=True,
                                                  seed=i))
    for _ in range(4):  # prefill (in chunks) and the first decode steps
        engine.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=max(args.sizes),
                                 max_seq_len=1024))
    step_ms(engine, max(args.sizes), 0.0, 8, args.prompt_len)  # warm-up: graphs, allocations
    for t in args.temperature:
        medians = {}
        for n in args.sizes:
            times = sorted(step_ms(engine, n, t, args.steps, args.prompt_len))
            q = statistics.quantiles(times, n=4)
            medians[n] = statistics.median(times)
            print(f"T={t} batch {n:3d}: median {medians[n]:.3f} ms (quartiles {q[0]:.3f}-{q[2]:.3f})", flush=True)
        # what plain_at would give from the powers of two alone, each bucket measured at its top
        model = CostModel(1)
        for n, ms in medians.items():
            if n == CostModel.bucket(n):
                for _ in range(2):
                    model.observe(n, 0, ms / 1e3)
        line = {n: round(model.plain_at(n) * 1e3, 3) for n in args.sizes if model.plain_at(n) is not None}
        print(f"T={t} plain_at from the powers of two (ms): {line}", flush=True)


if __name__ == "__main__":
    main()
