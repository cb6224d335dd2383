"""What a decode step's wall time depends on at batch > 1: every decode step of fixed-K
engines (n-gram, draft model) and of the plain engine on a batch workload, with its batch
size, the rows that got a draft, the draft tokens and the tokens it emitted, fitted by least
squares.

    plain step:  seconds = a + b * batch
    round:       seconds = a + b * batch + d * drafting rows + e * emitted tokens

A step is timed from the start of one `engine.step()` to the start of the next (the
scheduler's retirement of its tokens and reservation of the next step's positions
included); steps that also ran prefill chunks are left out. Rows go to `--out` as JSON
lines; the fits are printed per engine and temperature, over all batch sizes and per cost
bucket (the power of two at or above the batch size).

    PYTHONPATH=src python scripts/round_fit.py [--workload W2] [--temperature 0 1]
        [--variants plain ngram-k5 draft-k5] [--generations 2] [--out rows.jsonl]
        [--configs new old]

`--configs` builds the engines once per configuration, then runs their generations in turn
(alternating the order, so drift hits every engine alike): "new"
(the defaults), "old" (sampling, acceptance and draft-loop graphs only up to batch 16, and
index tensors filled row by row at every batch size: the code before 4a7432f and the
vectorized `layout_indices`), and prints, per bucket, the median step and the milliseconds
per token of each.

Why: the adaptive policy files a round's cost by batch bucket and longest draft alone,
as a ratio to a plain step (spec/costs.py); H100 per-round logs at W2 (n-gram, T=0) put
~60 us on each row that drafts, and every emitted token costs host time (its output) in
either mode, so a round of one draft and one of thirty were priced alike.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import numpy as np
import torch

import infer.cache.view as cache_view
from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.cuda_graphs import SMALL_BATCH_MAX
from infer.engine.engine import Engine
from plain_step_ab import _build

# configuration -> (GraphForward's sampling_batch_max, layout_indices' row-by-row limit)
CONFIGS = {"new": (SMALL_BATCH_MAX, cache_view._ROWWISE_MAX), "old": (16, 1 << 30)}


def bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def record_steps(engine: Engine, workload: str, temperature: float, seed: int) -> list[dict]:
    """One generation of the whole workload at once; a row per decode-only engine step."""
    runner = engine.runner
    specs = build_requests(WORKLOADS[workload], engine.vocab_size, engine.tokenizer).requests
    for i, spec in enumerate(specs):
        engine.add_request(spec.prompt_ids, SamplingParams(temperature=temperature, max_tokens=spec.max_tokens,
                                                           ignore_eos=True, seed=seed * 1000 + i))
    seen: dict = {}
    proposer = getattr(runner, "proposer", None)
    if proposer is not None:
        propose = proposer.propose

        def proposing(requests, ks):  # noqa: ANN001, ANN202
            drafts = propose(requests, ks)
            seen["drafting"] = sum(1 for d in drafts if d.token_ids)
            seen["dtok"] = sum(len(d.token_ids) for d in drafts)
            return drafts

        proposer.propose = proposing
    decode, step = runner._decode, runner.step

    def decoding(requests):  # noqa: ANN001, ANN202
        outputs = decode(requests)
        seen["b"], seen["emitted"] = len(requests), len(outputs)
        return outputs

    def stepping(prefill, requests):  # noqa: ANN001, ANN202
        seen["prefill"] = bool(prefill)
        return step(prefill, requests)

    runner._decode, runner.step = decoding, stepping
    rows: list[dict] = []
    pending: dict | None = None
    try:
        while engine.has_unfinished():
            start = time.perf_counter()
            if pending is not None:
                pending["sec"] = start - pending.pop("start")
                rows.append(pending)
                pending = None
            seen.clear()
            engine.step()
            if "b" in seen and not seen.pop("prefill", True):
                pending = dict(seen, start=start)
    finally:
        runner._decode, runner.step = decode, step
        if proposer is not None:
            proposer.propose = propose
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return rows


def fit(rows: list[dict], columns: tuple[str, ...]) -> tuple[list[float], float] | None:
    """Least squares seconds ~ 1 + columns (us), and the residuals' median absolute value."""
    if len(rows) < len(columns) + 3:
        return None
    x = np.array([[1.0] + [float(r[c]) for c in columns] for r in rows])
    y = np.array([r["sec"] * 1e6 for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return list(coef), float(np.median(np.abs(y - x @ coef)))


def report(label: str, rows: list[dict]) -> None:
    rounds = [r for r in rows if r.get("drafting")]
    plain = [r for r in rows if not r.get("drafting")]
    ms = sum(r["sec"] for r in rows) / max(1, sum(r["emitted"] for r in rows)) * 1e3
    print(f"\n== {label}: {len(plain)} plain steps, {len(rounds)} rounds; decode steps {ms:.4f} ms a token",
          flush=True)
    by_bucket: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_bucket[bucket(r["b"])].append(r["sec"] * 1e6)
    print("  median step (us) by bucket: " + ", ".join(f"{b}: {float(np.median(v)):.0f}"
                                                      for b, v in sorted(by_bucket.items())), flush=True)
    for name, part, columns in (("plain", plain, ("b",)), ("rounds", rounds, ("b", "drafting", "emitted")),
                                ("rounds", rounds, ("b", "emitted")), ("rounds", rounds, ("b", "drafting"))):
        groups: dict[object, list[dict]] = defaultdict(list)
        for r in part:
            groups["all"].append(r)
            groups[bucket(r["b"])].append(r)
        for key, group in sorted(groups.items(), key=lambda kv: (kv[0] != "all", kv[0] if kv[0] != "all" else 0)):
            got = fit(group, columns)
            if got is None:
                continue
            coef, resid = got
            terms = " + ".join(f"{c:.1f}*{n}" for c, n in zip(coef[1:], columns, strict=True))
            print(f"  {name:6s} bucket {key!s:>3}: n={len(group):4d}  us = {coef[0]:.1f} + {terms}"
                  f"   (median |residual| {resid:.1f} us)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["W2"], choices=["W2", "W2-prefix"])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--variants", nargs="+", default=["plain", "ngram-k5", "draft-k5"])
    ap.add_argument("--generations", type=int, default=2)
    ap.add_argument("--out", default=None, help="write every row here (JSON lines)")
    ap.add_argument("--configs", nargs="+", default=["new"], choices=sorted(CONFIGS))
    args = ap.parse_args()
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    engines = {}
    for config in args.configs:  # every configuration's engines first, then their generations in turn
        sampling_max, _ = CONFIGS[config]
        for name, engine in _build(tuple(args.variants), 32, cuda_graph_sampling_batch_max=sampling_max).items():
            if name in args.variants:
                engines[(config, name)] = engine
    try:
        for w in args.workload:
            for t in args.temperature:
                rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
                order = list(engines)
                for g in range(args.generations + 1):  # generation 0 warms up
                    for config, name in order if g % 2 else reversed(order):  # drift hits every engine alike
                        cache_view._ROWWISE_MAX = CONFIGS[config][1]
                        got = record_steps(engines[(config, name)], w, t, g)
                        if g:
                            rows[(config, name)].extend(got)
                for (config, name), got in rows.items():
                    report(f"[{config}] {w} T={t:g} {name}", got)
                    if out is not None:
                        for r in got:
                            out.write(json.dumps(dict(r, workload=w, temperature=t, variant=name,
                                                      config=config)) + "\n")
    finally:
        cache_view._ROWWISE_MAX = CONFIGS["new"][1]
        if out is not None:
            out.close()

if __name__ == "__main__":
    main()
