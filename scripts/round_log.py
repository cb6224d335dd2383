"""Per-round log of an adaptive engine on a batch workload (W2, W2-prefix) on the demo
target: for every step whose choice gave some request k > 0, the batch size, how many
requests were given k > 0 and how many got a draft, the policy's expected tokens
(`pred`: one for each request without a draft) against the tokens emitted, the round's
priced cost (`cost`, kappa applied; `raw`, measured) and its wall time against the plain
baseline the engine holds (`sec`, `plain`), the draft's catch-up (`switch`), whether no
round's cost was fresh at that batch size (`calibrated_only`: one request probes early); then a
summary by cost bucket, and a census of the full choices at batch > 16 (rounds or not,
vetoed by the batch's economics, requests without evidence, backing off after a miss, with an
n-gram table, being built, refused one by `admit`; their median estimate). Each repetition runs the workload in the engine's own plain mode
first (the same instance through the plain runner's methods) and then adaptively.

    PYTHONPATH=src python scripts/round_log.py VARIANT TEMPERATURE REPETITIONS [WORKLOAD]
    (VARIANT: an adaptive variant of scripts/plain_step_ab.py, e.g. ngram-adaptive)

Why: at W2 T=0 (H100, n-gram) the adaptive engine lost 10-15 % while its episodes' kappa
stayed at 1; the log showed predictions and emitted tokens agreeing, rounds at batch 32
about breaking even, and the loss in the tables' upkeep (run 18b/18c).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch

from infer.bench.workloads import WORKLOADS, build_requests
from infer.spec.policy import expected_tokens
from plain_step_ab import _build, ms_per_token, plain_mode


def _rounded(entry: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}


def main() -> None:
    variant, temperature, repetitions = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    workload = sys.argv[4] if len(sys.argv) > 4 else "W2"
    engine = _build((variant,), WORKLOADS[workload].num_requests)[variant]
    runner, policy = engine.runner, engine.runner.policy
    work = build_requests(WORKLOADS[workload], engine.vocab_size, engine.tokenizer)
    log: list[dict] = []
    entry: dict = {}
    choose, verify, decode = policy.choose, runner._verify, runner._speculative_decode

    census: list[dict] = []  # full choices (not a standing plain decision) at batch > 16

    def choosing(requests, *args):  # noqa: ANN001, ANN002, ANN202
        steps = policy._steps
        ks = choose(requests, *args)
        if policy._steps != steps and len(requests) > 16:
            ests = [policy._est.get(r.request_id) for r in requests]
            table = getattr(runner.proposer, "table", None)
            rates = sorted(e.accepted / e.trials for e in ests if e is not None and e.evidence)
            census.append(dict(b=len(requests), ks=sum(map(bool, ks)),
                               vetoed=bool(policy._quiet and policy._quiet.vetoed),
                               no_evidence=sum(1 for e in ests if e is None or not e.evidence),
                               backing_off=sum(1 for e in ests if e is not None and policy._steps < e.miss_until),
                               tables=sum(1 for r in requests if table is not None and table(r.request_id) is not None),
                               building=len(getattr(runner.proposer, "_building", ())),
                               refused=sum(1 for r in requests if hasattr(runner.proposer, "admits")
                                           and not runner.proposer.admits(r)),
                               median_a=rates[len(rates) // 2] if rates else None))
        entry.clear()
        if any(ks):
            table = policy._table.get((runner.cost_model.bucket(len(requests)), temperature > 0))
            ests = [policy._est.get(r.request_id) for r in requests]
            entry.update(b=len(requests), chosen=sum(1 for k in ks if k), kmax=max(ks),
                         pred=sum(expected_tokens(e.accepted / e.trials, k) if k else 1.0 for e, k in zip(ests, ks)),
                         cost=table.costs[max(ks)] if table else None, raw=table.raw[max(ks)] if table else None,
                         probes=sum(1 for e in ests if e.probing),
                         calibrated_only=bool(table and table.calibrated_only))
        return ks

    def verifying(requests, drafts):  # noqa: ANN001, ANN202
        entry.update(drafting=sum(1 for d in drafts if d.token_ids), dtok=sum(len(d.token_ids) for d in drafts))
        return verify(requests, drafts)

    def deciding(requests, *args):  # noqa: ANN001, ANN002, ANN202
        start = time.perf_counter()
        out = decode(requests, *args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if entry:
            entry.setdefault("drafting", 0)
            entry.update(sec=time.perf_counter() - start, emitted=len(out),
                         switch=getattr(runner.proposer, "catch_up_seconds", 0.0),
                         plain=runner.cost_model.step_seconds(len(requests), 0, temperature > 0))
            log.append(dict(entry))
        entry.clear()
        return out

    policy.choose, runner._verify, runner._speculative_decode = choosing, verifying, deciding
    ms_per_token(engine, work, temperature, 256)  # warm-up
    for rep in range(repetitions):
        log.clear()
        census.clear()
        with plain_mode(engine):
            plain = ms_per_token(engine, work, temperature, 256)
        adaptive = ms_per_token(engine, work, temperature, 256)
        print(f"rep {rep}: adaptive {adaptive:.4f} plain-mode {plain:.4f} ms/token (x{plain / adaptive:.3f}); "
              f"{len(log)} steps with k > 0")
        for e in log[:40]:
            print("  ", _rounded(e))
        buckets: dict[int, list[dict]] = defaultdict(list)
        for e in log:
            buckets[runner.cost_model.bucket(e["b"])].append(e)
        for bucket, es in sorted(buckets.items()):
            rounds = [e for e in es if e["drafting"] and e["plain"]]
            print(f"   bucket {bucket}: {len(es)} asks, {len(rounds)} rounds, chosen {sum(e['chosen'] for e in es)}, "
                  f"drafting {sum(e['drafting'] for e in es)}, probes {sum(e['probes'] for e in es)}, sec/plain "
                  f"{statistics.mean(e['sec'] / e['plain'] for e in rounds) if rounds else 0:.2f}, pred/b "
                  f"{statistics.mean(e['pred'] / e['b'] for e in es):.2f}, emitted/b "
                  f"{statistics.mean(e['emitted'] / e['b'] for e in es):.2f}, "
                  f"their seconds {sum(e['sec'] for e in es) * 1e3:.1f} ms")
        print(f"   learned priors (sampled -> acceptance): {policy._learned}")
        if census:  # why batches above 16 speculated or not
            print(f"   full choices at batch > 16: {len(census)}, with rounds {sum(1 for c in census if c['ks'])}, "
                  f"vetoed {sum(c['vetoed'] for c in census)}; per choice: no evidence "
                  f"{statistics.mean(c['no_evidence'] for c in census):.1f}, backing off "
                  f"{statistics.mean(c['backing_off'] for c in census):.1f}, tables "
                  f"{statistics.mean(c['tables'] for c in census):.1f} (building "
                  f"{statistics.mean(c['building'] for c in census):.1f}, refused "
                  f"{statistics.mean(c['refused'] for c in census):.1f}) of "
                  f"{statistics.mean(c['b'] for c in census):.1f}; median estimate by choice "
                  f"{[round(c['median_a'], 2) for c in census[:: max(1, len(census) // 12)] if c['median_a'] is not None]}")
    if policy.calibration is not None:
        print("kappa sums (realized, predicted) by (bucket, sampled):", policy.calibration._sums)
    for bucket in (32, 16, 8):
        print(bucket, runner.cost_model.relative_costs(bucket, temperature > 0), policy._table.get((bucket, temperature > 0)))


if __name__ == "__main__":
    main()
