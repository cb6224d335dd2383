"""Benchmark results as text: one console line per measurement, a compact console table,
and Markdown tables for docs/benchmarks.md (GPU named, ratios side by side).

    python -m infer_bench.report results/*.json > tables.md
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from infer_bench.results import PEER_KINDS, SWEEP_KIND, BenchRun, Measurement, load_run
from infer_bench.serve import SERVE_KIND


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers to a short string: None -> '-', floats to `digits` significant figures."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 10 ** digits:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def first_error_line(m: Measurement) -> str:
    return (m.error or "").splitlines()[0] if m.error else ""


def failed_row(m: Measurement, width: int, label: str | None = None) -> list[Any]:
    """A table row of `width` columns for a measurement that did not succeed."""
    return [label or m.name, m.status, first_error_line(m)[:80]] + [None] * (width - 3)


def measurement_line(m: Measurement) -> str:
    """One line for the console while a run is going."""
    if not m.ok:
        return f"[{m.status}] {m.name}: {first_error_line(m)}"
    d, x = m.derived, m.metrics
    parts = [f"[ok] {m.name} ({m.elapsed_s:.1f} s)"]
    if m.kind in ("engine", *PEER_KINDS, SWEEP_KIND):
        parts.append(f"{fmt(x.get('primary_rate'))} tok/s")
        if x.get("ttft_mean_s") is not None:
            parts.append(f"TTFT {fmt(_ms(x['ttft_mean_s']))} ms")
    if m.kind == SERVE_KIND:
        parts.append(f"{fmt(x.get('request_throughput'))} req/s, {fmt(x.get('output_tokens_per_s'))} tok/s, "
                     f"{x.get('completed')}/{x.get('requests')} completed; TTFT p50/p99 "
                     f"{fmt(_ms(x.get('ttft_p50_s')))}/{fmt(_ms(x.get('ttft_p99_s')))} ms, TPOT "
                     f"{fmt(_ms(x.get('tpot_p50_s')))}/{fmt(_ms(x.get('tpot_p99_s')))} ms")
    if m.kind == "bandwidth":
        parts.append(f"{fmt(x.get('gb_per_s'))} GB/s")
    if m.kind == "roofline":
        parts.append(f"{fmt(x.get('tokens_per_s'))} tok/s ({fmt(x.get('step_ms'))} ms/step)")
    if m.kind == "batch_sweep":
        rates, limit = m.metrics.get("tokens_per_s", {}), d.get("of_bytes_limit_by_batch", {})
        return f"{m.name}: " + ", ".join(f"b{b} {fmt(r)} tok/s" + (f" ({fmt(limit[b])} of bytes limit)"
                                                                     if b in limit else "") for b, r in rates.items())
    if m.kind == "prefill":
        parts.append(f"{fmt(x.get('prompt_tokens'))} prompt tokens in {fmt(_ms(x.get('wall_s')))} ms: "
                     f"{fmt(x.get('prefill_tokens_per_s'))} tok/s, {fmt(d.get('model_tflops_per_s'))} TFLOP/s, "
                     f"MFU {fmt(d.get('mfu'))}" + (f" ({d['mfu_note']})" if d.get("mfu_note") else ""))
    if m.kind == "spec_costs":
        parts.append(f"target {fmt(x.get('target_step_ms'))} ms, c = {fmt(x.get('c'))}")
    if m.kind == "collectives":
        parts.append(f"step {fmt(x.get('step_ms'))} ms: all-reduce {fmt(x.get('all_reduce_ms_per_step'))} ms "
                     f"({fmt(x.get('all_reduce_share_of_step'))} of it), all-gather "
                     f"{fmt(x.get('all_gather_ms_per_step'))} ms, all collectives "
                     f"{fmt(x.get('collectives_share_of_step'))}")
    for key, label in (("speedup", "x baseline"), ("decode_speedup", "x decode"), ("roofline_fraction", "of roofline"),
                       ("efficiency", "efficiency"), ("length_vs_chain", "tok/round x chain")):
        if d.get(key) is not None:
            parts.append(f"{fmt(d[key])} {label}")
    if m.kind == SWEEP_KIND:
        parts.append(f"controlled acceptance {fmt(d.get('acceptance'))} at alpha {fmt(m.params.get('alpha'))}, "
                     f"projected {fmt(d.get('projected_speedup'))} / with overhead "
                     f"{fmt(d.get('projected_speedup_with_overhead'))}")
    if x.get("acceptance_rate") is not None:
        parts.append(f"accept {fmt(x['acceptance_rate'])}, {fmt(x.get('mean_accepted_length'))} tok/round")
    if x.get("prefix_hit_rate") is not None:
        parts.append(f"prefix hit {fmt(x['prefix_hit_rate'])}")
    return "  ".join(parts)


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return lines


def _short(m: Measurement) -> str:
    return m.name.rsplit("/", 1)[-1] + (" (paired)" if m.metrics.get("paired_speedup") else "")


ENGINE_HEADER = ("variant", "tok/s", "decode tok/s", "TTFT ms", "x baseline", "of roofline", "acceptance",
                 "tok/round", "predicted", "efficiency", "prefix hit", "greedy match", "tokens")


def engine_row(m: Measurement) -> list[Any]:
    if not m.ok:
        return failed_row(m, len(ENGINE_HEADER), _short(m))
    x, d = m.metrics, m.derived
    tokens = x.get("output_tokens")
    if tokens is not None and tokens != x.get("expected_output_tokens"):
        tokens = f"{tokens} (expected {x.get('expected_output_tokens')})"
    return [_short(m) + (f" ({PEER_KINDS[m.kind]})" if m.kind in PEER_KINDS else ""), x.get("tokens_per_s"),
            x.get("decode_tokens_per_s"), _ms(x.get("ttft_mean_s")), d.get("speedup"), d.get("roofline_fraction"),
            x.get("acceptance_rate"), x.get("mean_accepted_length"), d.get("predicted_speedup"), d.get("efficiency"),
            x.get("prefix_hit_rate"), _match(m), tokens]


def _match(m: Measurement) -> str | None:
    """Greedy tokens equal to the baseline's, of those saved (same weights: should be all)."""
    n = m.derived.get("greedy_prefix_match")
    saved = len(m.metrics.get("first_output_ids") or [])
    return None if n is None else f"{n}/{saved}"


def environment_lines(run: BenchRun) -> list[str]:
    env = run.environment
    gpu = env.get("gpu") or f"no GPU ({env.get('device')})"
    bw = run.get("bandwidth")
    bw_text = f", copy bandwidth {fmt(bw.metrics.get('gb_per_s'))} GB/s" if bw is not None and bw.ok else ""
    return [f"Suite `{run.suite}`, {run.created}: **{gpu}**{bw_text}; torch {env.get('torch')}, "
            f"CUDA {env.get('cuda')}, transformers {env.get('transformers')}, Python {env.get('python')}, "
            f"infer {env.get('infer_commit')}."]


def markdown(run: BenchRun) -> str:
    """Every table of one run, grouped as the suite grouped them."""
    out = [f"### {run.suite} ({run.environment.get('gpu') or 'CPU'})", ""] + environment_lines(run) + [""]
    roofs = [m for m in run.measurements if m.kind == "roofline" and m.ok]
    if roofs:
        out += ["Roofline (batch-1 decode: weight bytes / copy bandwidth)", ""]
        out += _table(("model", "weights", "weights GB", "bandwidth GB/s", "step ms", "tok/s"),
                      [(m.params.get("model"), m.params.get("quantization") or m.params.get("dtype"),
                        m.metrics.get("weight_gb"), m.metrics.get("bandwidth_gb_per_s"),
                        m.metrics.get("step_ms"), m.metrics.get("tokens_per_s")) for m in roofs]) + [""]
    out += _cost_tables(run)
    out += _collective_table(run)
    out += _sweep_table(run)
    prefills = [m for m in run.measurements if m.kind == "prefill" and m.ok]
    if prefills:
        out += ["Prefill to the first token (model FLOPs / wall time / peak dense bf16 FLOPs)", ""]
        out += _table(("row", "prompt tokens", "wall ms", "tok/s", "TFLOP/s", "MFU"),
                      [(m.name, m.metrics.get("prompt_tokens"), _ms(m.metrics.get("wall_s")),
                        m.metrics.get("prefill_tokens_per_s"), m.derived.get("model_tflops_per_s"),
                        m.derived.get("mfu")) for m in prefills]) + [""]
    out += _acceptance_tables(run)
    for group, members in run.groups((SERVE_KIND,)).items():
        out += [f"**{group}** (open loop, Poisson arrivals; times in ms)", ""]
        out += _table(SERVE_HEADER, [serve_table_row(m) for m in members]) + [""]
    for group, members in run.groups(("engine", *PEER_KINDS)).items():
        out += [f"**{group}**", ""] + _table(ENGINE_HEADER, [engine_row(m) for m in members]) + [""]
    failed = [m for m in run.measurements if not m.ok]
    if failed:
        out += ["Not measured:", ""]
        out += [f"- `{m.name}`: {m.status}: {first_error_line(m)}" for m in failed]
        out += [""]
    return "\n".join(out)


def _cost_tables(run: BenchRun) -> list[str]:
    out: list[str] = []
    costs = [m for m in run.measurements if m.kind == "spec_costs" and m.ok]
    if costs:
        k_max = max(len(m.metrics.get("verify_ratio", [])) for m in costs) - 1
        header = ("target / draft", "graphs", "target ms", "draft ms", "c") + tuple(
            f"v({k})" for k in range(1, k_max + 1))
        rows = []
        for m in costs:
            v = m.metrics.get("verify_ratio", [])
            rows.append([f"{m.params.get('target')} / {m.params.get('draft')}", m.params.get("use_cuda_graphs"),
                         m.metrics.get("target_step_ms"), m.metrics.get("draft_step_ms"), m.metrics.get("c")]
                        + [v[k] if k < len(v) else None for k in range(1, k_max + 1)])
        out += ["Step costs at batch 1 (c = draft step / target step; v(K) = verify K+1 tokens / one step)", ""]
        out += _table(header, rows) + [""]
    for m in run.measurements:
        if m.kind != "projection" or not m.ok:
            continue
        for key, title in (("paper", "paper's factor, v = 1"), ("measured_verify", "measured v(K)")):
            p = m.metrics.get(key)
            if not p:
                continue
            out += [f"Projected speedup from c = {fmt(p['c'])} ({m.params.get('costs')}; {title})", ""]
            out += _table(("alpha",) + tuple(f"K={k}" for k in p["ks"]) + ("best K",),
                          [[a, *row, best] for a, row, best in zip(p["alphas"], p["table"], p["best_k"], strict=True)])
            out += [""]
        t = m.metrics.get("trees")
        if t:
            out += [f"Projected speedup of static trees from c = {fmt(t['c'])} ({m.params.get('costs')}; measured "
                    "v(N), one draft step a level; optimistic for wide levels), beside the best chain", ""]
            out += _table(("alpha", *t["trees"], "best chain"),
                          [[a, *row, chain] for a, row, chain in zip(t["alphas"], t["table"], t["best_chain"],
                                                                     strict=True)])
            out += [""]
    return out


def _collective_table(run: BenchRun) -> list[str]:
    rows = [m for m in run.measurements if m.kind == "collectives" and m.ok]
    if not rows:
        return []
    header = ("measurement", "step ms", "all-reduce ms", "all-reduces", "all-gather ms", "collectives ms",
              "share of step", "share of GPU time")
    out = ["Collectives per batch-1 decode step (tensor parallelism; kernel time from a profile, rank 0)", ""]
    return out + _table(header, [[m.name, m.metrics.get("step_ms"), m.metrics.get("all_reduce_ms_per_step"),
                                  m.metrics.get("all_reduce_calls_per_step"), m.metrics.get("all_gather_ms_per_step"),
                                  m.metrics.get("collectives_ms_per_step"), m.metrics.get("collectives_share_of_step"),
                                  m.metrics.get("collectives_share_of_gpu_time")] for m in rows]) + [""]


def _sweep_table(run: BenchRun) -> list[str]:
    sweeps = [m for m in run.measurements if m.kind == "batch_sweep" and m.ok]
    if not sweeps:
        return []
    batches = sorted({int(b) for m in sweeps for b in m.metrics.get("tokens_per_s", {})})
    out = ["Decode tokens/s against batch size (CUDA graphs; step time at a row's largest batch / at its "
           "smallest; of bytes limit: (weights + KV read) / copy bandwidth over the step, at its largest batch)", ""]
    rows = []
    for m in sweeps:
        tps, ms = m.metrics.get("tokens_per_s", {}), m.metrics.get("ms_per_step", {})
        own = sorted(ms, key=int)
        ratio = ms[own[-1]] / ms[own[0]] if len(own) > 1 else None
        rows.append([m.name, *(tps.get(str(b)) for b in batches), ratio, m.derived.get("of_bytes_limit"),
                     m.derived.get("speedup")])
    return out + _table(("sweep", *(f"b={b}" for b in batches), "step ratio", "of bytes limit", "x baseline"),
                        rows) + [""]


SERVE_HEADER = ("rate /s", "completed", "req/s", "of offered", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                "TPOT p99", "E2E p50", "E2E p99")


def serve_table_row(m: Measurement) -> list[Any]:
    """A serve measurement as a report row (SERVE_HEADER; times in ms)."""
    if not m.ok:
        return failed_row(m, len(SERVE_HEADER))
    x = m.metrics
    return [m.params.get("request_rate"), f"{x.get('completed')}/{x.get('requests')}", x.get("request_throughput"),
            m.derived.get("of_offered_rate"), x.get("output_tokens_per_s"),
            *(_ms(x.get(f"{key}_s")) for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99"))]


ACCEPTANCE_HEADER = ("shape", "alpha", "acceptance", "tok/round", "round ms", "round ms at a=0", "overhead ms",
                     "x plain", "projected", "projected + overhead", "measured / projected", "off-record rounds",
                     "greedy match")


def _acceptance_tables(run: BenchRun) -> list[str]:
    """The acceptance sweep's rows, one table a group, labelled controlled acceptance."""
    out: list[str] = []
    for group, members in run.groups((SWEEP_KIND,)).items():
        out += [f"**{group}**: controlled acceptance (an oracle chooses which drafts match the target's greedy "
                "continuation, each with probability alpha; the draft and target forwards and the rounds cost what "
                "they do). Projections at the measured acceptance with the run's c and v(N); + overhead: the "
                "round's time at acceptance 0 beyond its draft steps and v(N)", ""]
        rows = []
        for m in members:
            x, d, p = m.metrics, m.derived, m.params
            if not m.ok:
                rows.append(failed_row(m, len(ACCEPTANCE_HEADER)))
                continue
            rows.append([p.get("shape"), p.get("alpha"), d.get("acceptance"), x.get("mean_accepted_length"),
                         x.get("round_ms"), x.get("round_ms_zero_acceptance"), d.get("round_overhead_ms"),
                         d.get("speedup"), d.get("projected_speedup"), d.get("projected_speedup_with_overhead"),
                         d.get("measured_vs_projection"), x.get("oracle_off_record_rounds"), _match(m)])
        out += _table(ACCEPTANCE_HEADER, rows) + [""]
    return out


def console_table(run: BenchRun) -> str:
    """A compact plain-text summary printed at the end of a run."""
    lines = environment_lines(run)
    for m in run.measurements:
        lines.append(measurement_line(m))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m infer_bench.report RESULT.json [...]", file=sys.stderr)
        return 2
    print("\n\n".join(markdown(load_run(p)) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
