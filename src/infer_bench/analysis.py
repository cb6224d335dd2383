"""Ratios between the measurements of one run (pure functions over the records).

`derive_all` fills each measurement's `derived` from the rows its `refs` name: "baseline"
(speedup, paired when timed in alternation), "roofline", "costs" (the paper's prediction
and the efficiency), "chain" (a tree's tokens per round over the chain's) and "bandwidth"
(a batch sweep's bytes limits); prefill rows get their MFU, acceptance-sweep rows their
projections. What each ratio means: docs/benchmarks.md, "Method".
"""

from __future__ import annotations

from typing import Any

from infer_bench.results import SWEEP_KIND, BenchRun, Measurement
from infer_bench.serve import SERVE_KIND, serve_derived
from infer_bench.roofline import decode_roofline, decode_step_bytes
from infer_bench.theory import PEAK_BF16_FLOPS, efficiency, num_nodes, peak_bf16_flops, round_projection
from infer.speculative.theory import alpha_from_mean_length, walltime_factor


def derive_all(run: BenchRun) -> None:
    """Fill `derived` of every measurement from its refs (recomputed from scratch)."""
    for m in run.measurements:
        m.derived = derive(m, run) if m.ok else {}


def derive(m: Measurement, run: BenchRun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if m.kind == SERVE_KIND:
        return serve_derived(m.metrics, m.params)
    if m.kind == "prefill":
        return prefill_mfu(m.metrics, run.environment.get("gpu"))
    bandwidth = _ref(m, run, "bandwidth")
    if m.kind == "batch_sweep":
        out = bytes_limits(m.metrics, bandwidth.metrics["bytes_per_s"]) if bandwidth is not None else {}
        base = _ref(m, run, "baseline")
        return out if base is None else {**out, **batch_speedups(m.metrics, base.metrics), "baseline": base.name}
    base = _ref(m, run, "baseline")
    if base is not None and m.metrics.get("primary_rate") and base.metrics.get("primary_rate"):
        out["speedup"] = m.metrics["primary_rate"] / base.metrics["primary_rate"]
        out["baseline"] = base.name
        if m.metrics.get("paired_speedup"):
            out["speedup_unpaired"], out["speedup"] = out["speedup"], m.metrics["paired_speedup"]
        rate, base_rate = m.metrics.get("decode_tokens_per_s"), base.metrics.get("decode_tokens_per_s")
        if rate and base_rate and m.metrics["primary_rate"] != rate:  # (a batch: its throughput counts prefill)
            out["decode_speedup"] = rate / base_rate  # each request's tokens after its first, on average
        agree = common_prefix(m.metrics.get("first_output_ids"), base.metrics.get("first_output_ids"))
        if agree is not None and _greedy(m) and _greedy(base) and _structured(m) == _structured(base):
            out["greedy_prefix_match"] = agree
    roof = _ref(m, run, "roofline")
    rate = m.metrics.get("decode_tokens_per_s")
    if roof is not None and rate and roof.metrics.get("tokens_per_s"):
        out["roofline_fraction"] = rate / roof.metrics["tokens_per_s"]
    costs = _ref(m, run, "costs")
    if m.kind == SWEEP_KIND:
        out.update(sweep_projection(m, costs, out.get("speedup")))
    elif costs is not None and "speedup" in out:
        out.update(spec_prediction(m, costs, out["speedup"]))
    chain = _ref(m, run, "chain")
    if chain is not None and m.metrics.get("mean_accepted_length") and chain.metrics.get("mean_accepted_length"):
        out["length_vs_chain"] = m.metrics["mean_accepted_length"] / chain.metrics["mean_accepted_length"]
    return out


def bytes_limits(metrics: dict[str, Any], bytes_per_s: float) -> dict[str, Any]:
    """Per batch of a sweep: its bytes limit in ms (weights + KV read at its context, over
    `bytes_per_s`) and that over the measured step time; `of_bytes_limit` at the largest batch."""
    ms, context = metrics.get("ms_per_step", {}), metrics.get("context_tokens", {})
    weights, kv = metrics.get("weight_bytes"), metrics.get("kv_bytes_per_token")
    if not weights or kv is None or not ms or set(context) != set(ms):
        return {}  # (a record from before the sweep stored them)
    limit = {b: decode_roofline(decode_step_bytes(weights, kv, int(b), context[b]), bytes_per_s).step_s * 1e3
             for b in ms}
    fraction = {b: limit[b] / ms[b] for b in ms}
    largest = max(ms, key=int)
    return {"bytes_limit_ms": limit, "of_bytes_limit_by_batch": fraction, "of_bytes_limit": fraction[largest],
            "of_bytes_limit_batch": int(largest)}


def batch_speedups(metrics: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A sweep's decode steps against a baseline sweep's, at the batch sizes both ran:
    `speedup_by_batch` (baseline ms / ms) and `speedup` at the largest of them."""
    ms, base_ms = metrics.get("ms_per_step", {}), base.get("ms_per_step", {})
    common = sorted(set(ms) & set(base_ms), key=int)
    if not common:
        return {}
    by_batch = {b: base_ms[b] / ms[b] for b in common}
    return {"speedup_by_batch": by_batch, "speedup": by_batch[common[-1]]}


def prefill_mfu(metrics: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    """Model FLOPs utilisation of a prefill row on `gpu` (its name; None: no GPU)."""
    flops, wall = metrics.get("model_flops"), metrics.get("wall_s")
    if not flops or not wall:
        return {}
    peak = peak_bf16_flops(gpu)
    out: dict[str, Any] = {"model_tflops_per_s": flops / wall / 1e12, "peak_bf16_tflops": peak and peak / 1e12,
                           "mfu": flops / wall / peak if peak else None}
    if peak is None and not gpu:
        out["mfu_note"] = "no GPU: the MFU compares with a GPU's peak bf16 FLOPs"
    elif peak is None:
        out["mfu_note"] = (f"unknown GPU {gpu!r}: no peak bf16 FLOPs for it (known: {', '.join(PEAK_BF16_FLOPS)}); "
                           "add it to PEAK_BF16_FLOPS in infer_bench/theory.py")
    return out


def spec_prediction(m: Measurement, costs: Measurement, speedup: float) -> dict[str, Any]:
    """Paper prediction and efficiency of a fixed-K speculative run."""
    engine = m.params.get("engine", {})
    mean_len = m.metrics.get("mean_accepted_length")
    if (not engine.get("use_speculative_decoding") or engine.get("spec_policy") != "fixed" or not mean_len
            or engine.get("spec_tree")):
        return {}
    k = int(engine["spec_length"])
    c = 0.0 if engine.get("speculative_method") != "draft_model" else costs.metrics.get("c")
    if c is None:
        return {}
    alpha = alpha_from_mean_length(mean_len, k)
    predicted = walltime_factor(alpha, k, c)
    out: dict[str, Any] = {"alpha_implied": alpha, "c_used": c, "k": k, "predicted_speedup": predicted,
                           "efficiency": efficiency(speedup, predicted)}
    verify = costs.metrics.get("verify_ratio") or []
    if len(verify) > k:
        general = walltime_factor(alpha, k, c, verify[k])
        out.update(predicted_speedup_measured_verify=general, efficiency_measured_verify=efficiency(speedup, general))
    return out


def sweep_projection(m: Measurement, costs: Measurement | None, speedup: float | None) -> dict[str, Any]:
    """A controlled-acceptance row beside its projections, at its measured acceptance a (the
    oracle's accepted / tried nodes): the paper's factor with the measured c and v(N)
    (`projected_speedup`), and the same with the round's overhead (`round_overhead_ms`:
    the round's time at acceptance 0 beyond its draft steps and v(N) target steps) added to
    its cost (`projected_speedup_with_overhead`; `measured_vs_projection` = speedup / it)."""
    a, branching = m.metrics.get("oracle_acceptance"), m.params.get("branching")
    out: dict[str, Any] = {"acceptance": a, "alpha": m.params.get("alpha"), "acceptance_control": "controlled"}
    if a is None or not branching or costs is None:
        return out
    x = costs.metrics
    c, verify, target_ms, draft_ms = x.get("c"), x.get("verify_ratio") or [], x.get("target_step_ms"), \
        x.get("draft_step_ms")
    n = num_nodes(branching)
    if c is None or len(verify) <= n or not target_ms or draft_ms is None:
        return out
    out["projected_speedup"] = round_projection(a, branching, c, verify[n])
    zero = m.metrics.get("round_ms_zero_acceptance")
    if zero:
        overhead_ms = zero - (len(branching) * draft_ms + verify[n] * target_ms)
        out["round_overhead_ms"] = overhead_ms
        if verify[n] + overhead_ms / target_ms <= 0:  # the steps' costs over-count the round (noisy timings)
            return out
        projected = round_projection(a, branching, c, verify[n], overhead_ms / target_ms)
        out["projected_speedup_with_overhead"] = projected
        if speedup:
            out["measured_vs_projection"] = speedup / projected
    return out


def common_prefix(a: list[int] | None, b: list[int] | None) -> int | None:
    """Length of the common start of two token lists (None when either is missing)."""
    if not a or not b:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _greedy(m: Measurement) -> bool:
    return m.params.get("workload", {}).get("temperature", 1.0) == 0


def _structured(m: Measurement) -> Any:
    return m.params.get("workload", {}).get("structured")


def _ref(m: Measurement, run: BenchRun, role: str) -> Measurement | None:
    name = m.refs.get(role)
    if name is None:
        return None
    ref = run.get(name)
    return ref if ref is not None and ref.ok else None
