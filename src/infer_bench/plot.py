"""PNG charts of a benchmark results file (`infer bench --plot results.json`), with matplotlib:
one bar chart a measurement group, decode tokens/s against batch size, and the serving
latencies (bench/serve_plot.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from infer_bench.results import PEER_KINDS, BenchRun, Measurement


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "group"


def chartable(run: BenchRun) -> dict[str, list[Measurement]]:
    """Group -> the finished engine / peer measurements with a rate, in run order."""
    groups: dict[str, list[Measurement]] = {}
    for m in run.measurements:
        if m.ok and m.kind in ("engine", *PEER_KINDS) and m.metrics.get("primary_rate") is not None:
            groups.setdefault(m.group or m.name, []).append(m)
    return groups


def plot_run(run: BenchRun, out_dir: Path) -> list[Path]:
    """Write one PNG per group into `out_dir`; returns their paths (none when nothing ran)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, items in chartable(run).items():
        fig = Figure(figsize=(8, 0.6 * len(items) + 1.6), layout="constrained")
        ax = fig.subplots()
        names = [m.name.split("/", 1)[-1] for m in items]
        rates = [float(m.metrics["primary_rate"]) for m in items]
        bars = ax.barh(names, rates, color=["#4477aa" if m.kind == "engine" else "#aaaaaa" for m in items])
        ax.invert_yaxis()
        ax.set_xlabel("tokens / s")
        ax.set_title(f"{group}\n{run.suite}, {run.environment.get('gpu') or run.environment.get('device', '')}",
                     fontsize=10)
        labels = [_label(m) for m in items]
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
        ax.set_xlim(0, max(rates) * 1.25 if rates and max(rates) > 0 else 1)
        path = out_dir / f"{_slug(group)}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def plot_batch_sweeps(run: BenchRun, out_dir: Path) -> Path | None:
    """Decode tokens/s against batch size, one line per batch-sweep measurement (None when the
    run has none)."""
    sweeps = [m for m in run.measurements if m.ok and m.kind == "batch_sweep"]
    if not sweeps:
        return None
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for m in sweeps:
        rates = m.metrics["tokens_per_s"]
        batches = sorted(int(b) for b in rates)
        ax.plot(batches, [rates[str(b)] for b in batches], marker="o", label=m.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests decoding)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"decode throughput against batch size ({run.environment.get('device', '')})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = out_dir / "batch-sweep.png"
    fig.savefig(path, dpi=120)
    return path


def _label(m: Measurement) -> str:
    rate = float(m.metrics["primary_rate"])
    text = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
    speedup = m.derived.get("speedup")
    return f"{text} ({speedup:.2f}x)" if isinstance(speedup, (int, float)) else text


def plot_files(paths: Sequence[Path], out_dir: Path | None) -> list[Path]:
    """Charts of each results file, into `out_dir` or `<file>-charts/` beside it."""
    from infer_bench.results import load_run
    from infer_bench.serve_plot import plot_serving

    written = []
    for path in paths:
        run, target = load_run(path), out_dir or path.with_name(path.stem + "-charts")
        written += plot_run(run, target)
        sweep = plot_batch_sweeps(run, target)
        written += [sweep] if sweep is not None else []
        serving = plot_serving(run, target)
        written += [serving] if serving is not None else []
    return written
