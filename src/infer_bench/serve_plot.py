"""The serving suite's chart: TTFT, TPOT and end-to-end latency (p50 solid, p99 dashed)
against the offered request rate, one line per server (group) of the run. Needs matplotlib."""

from __future__ import annotations

import math
from pathlib import Path

from infer_bench.results import BenchRun, Measurement
from infer_bench.serve import SERVE_KIND

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT (per output token after the first)"), ("e2e", "end-to-end latency"))


def serving_groups(run: BenchRun) -> dict[str, list[Measurement]]:
    """Group -> its finished serve rows with a finite rate, by rate."""
    def finished_at_a_rate(m: Measurement) -> bool:
        rate = m.params.get("request_rate")
        return m.ok and isinstance(rate, (int, float)) and math.isfinite(rate)

    return {g: sorted(ms, key=lambda m: m.params["request_rate"])
            for g, ms in run.groups((SERVE_KIND,), finished_at_a_rate).items()}


def plot_serving(run: BenchRun, out_dir: Path) -> Path | None:
    """serving.png in `out_dir` (None when the run has no serve rows)."""
    groups = serving_groups(run)
    if not groups:
        return None
    from matplotlib.figure import Figure
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, title) in zip(axes, PANELS):
        for i, (group, items) in enumerate(groups.items()):
            rates = [float(m.params["request_rate"]) for m in items]
            color = f"C{i}"
            for q, style in (("p50", "-"), ("p99", "--")):
                values = [m.metrics.get(f"{key}_{q}_s") for m in items]
                points = [(r, v * 1e3) for r, v in zip(rates, values) if v is not None]
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=color, label=f"{group} {q}")
        ax.set_xscale("log")
        ticks = sorted({float(m.params["request_rate"]) for items in groups.values() for m in items})
        ax.set_xticks(ticks, [f"{r:g}" for r in ticks])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("request rate (requests / s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    where = run.environment.get("gpu") or run.environment.get("device", "")
    fig.suptitle(f"serving latency against request rate ({where})", fontsize=11)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "serving.png"
    fig.savefig(path, dpi=110)
    return path
