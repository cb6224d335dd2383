"""PNG charts of a benchmark results file (`infer bench --plot results.json`), with matplotlib.

One chart per measurement group (the tables of docs/benchmarks.md): the decode rate of each
engine or peer run that finished, as horizontal bars, labelled with its speedup over its
baseline where the run has one. Needs matplotlib (the `bench` extra).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from infer.bench.results import BenchRun, Measurement


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "group"


def chartable(run: BenchRun) -> dict[str, list[Measurement]]:
    """Group -> the finished engine / peer measurements with a rate, in run order."""
    groups: dict[str, list[Measurement]] = {}
    for m in run.measurements:
        if m.ok and m.kind in ("engine", "hf") and m.metrics.get("primary_rate") is not None:
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


def _label(m: Measurement) -> str:
    rate = float(m.metrics["primary_rate"])
    text = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
    speedup = m.derived.get("speedup")
    return f"{text} ({speedup:.2f}x)" if isinstance(speedup, (int, float)) else text


def plot_files(paths: Sequence[Path], out_dir: Path | None) -> list[Path]:
    """Charts of each results file, into `out_dir` or `<file>-charts/` beside it."""
    from infer.bench.results import load_run

    written = []
    for path in paths:
        written += plot_run(load_run(path), out_dir or path.with_name(path.stem + "-charts"))
    return written
