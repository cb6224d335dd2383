"""A benchmark row: one named measurement, what it measures, how to run it, what it needs.

`refs` names the rows a row is compared with: they run first, whichever suite selected the
row. An unmet `need` (an optional package, the demo models, enough GPUs) skips the row with
a hint saying how to meet it, instead of recording an error.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from infer_bench.results import BenchRun
from infer_bench.workloads import Workload

Outcome = tuple[dict[str, Any], dict[str, Any]]  # (params, metrics)


@dataclass
class HarnessOptions:
    """How a run measures (the `infer bench` flags that are not engine flags)."""

    device: str = "auto"
    output_len: int | None = None  # every workload generates exactly this many tokens (quick runs)
    warmup_tokens: int | None = None  # cap on warm-up tokens per request; None = full length
    max_seconds: float | None = None  # time budget for the whole run
    cost_repeats: int = 30
    repeats: int = 3  # timed runs per engine measurement; the median one is reported
    paired_instances: int = 1  # engines of each kind in a paired measurement (see run_engine)
    with_hf: bool = True  # run the transformers peers
    model: str | None = None  # replaces the demo target (speculation, smoke) or the custom workload's model
    draft_model: str | None = None  # replaces the demo draft
    threads: int | None = None  # CPU threads of the cost measurement; None = the engine's choice
    gpt_fast: str | None = None  # a gpt-fast checkout: its compiled decode runs as a peer row
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")
        if self.cost_repeats < 1 or self.repeats < 1 or (self.warmup_tokens is not None and self.warmup_tokens < 0):
            raise ValueError("cost_repeats and repeats must be >= 1 and warmup_tokens >= 0")
        if self.paired_instances < 1:
            raise ValueError(f"paired_instances must be >= 1, got {self.paired_instances}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")


class Context(Protocol):
    """What a row's `run` reads: the harness's device, options and the run so far."""

    device: torch.device
    options: HarnessOptions
    run: BenchRun

    def workload(self, workload: Workload) -> Workload: ...


class Need(Protocol):
    def missing(self, ctx: Context) -> str | None:
        """None when met; else what is missing and how to get it (one line)."""
        ...


@dataclass(frozen=True)
class Module:
    """An optional Python package (importable by `name`)."""

    name: str
    install: str  # the pip requirement that provides it

    def installed(self) -> bool:
        try:
            return importlib.util.find_spec(self.name) is not None
        except (ImportError, ValueError):  # a broken or half-removed package
            return False

    def missing(self, ctx: Context) -> str | None:
        return None if self.installed() else f"needs {self.name}, which is not installed: pip install '{self.install}'"


@dataclass(frozen=True)
class Files:
    """Model directories that must hold a config.json."""

    paths: tuple[Path, ...]
    hint: str

    def missing(self, ctx: Context) -> str | None:
        absent = [str(p) for p in self.paths if not (p / "config.json").is_file()]
        return f"{', '.join(absent)} missing: {self.hint}" if absent else None


@dataclass(frozen=True)
class CudaDevices:
    count: int

    def missing(self, ctx: Context) -> str | None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if ctx.device.type == "cuda" and have >= self.count:
            return None
        return f"needs {self.count} CUDA device(s) (--device cuda); this machine has {have}"


@dataclass(frozen=True)
class GptFastCheckout:
    """--gpt-fast PATH given, and PATH holds gpt-fast's model.py and generate.py."""

    def missing(self, ctx: Context) -> str | None:
        if ctx.options.gpt_fast is None:
            return "needs a gpt-fast checkout: --gpt-fast PATH (git clone https://github.com/pytorch-labs/gpt-fast)"
        absent = [f for f in ("model.py", "generate.py") if not (Path(ctx.options.gpt_fast) / f).is_file()]
        return f"--gpt-fast {ctx.options.gpt_fast} lacks {', '.join(absent)}" if absent else None


@dataclass(frozen=True)
class NoPeers:
    """Unmet under --no-hf: the transformers peers are left out on request."""

    def missing(self, ctx: Context) -> str | None:
        return None if ctx.options.with_hf else "left out (--no-hf)"


@dataclass(frozen=True)
class Measured:
    """Another row of this run that must have succeeded (a projection's costs, a roofline's
    bandwidth): when it was skipped or failed, this row is skipped, its error counted once."""

    name: str

    def missing(self, ctx: Context) -> str | None:
        m = ctx.run.get(self.name)
        return None if m is not None and m.ok else f"needs {self.name}, which was not measured in this run"


@dataclass(frozen=True)
class Row:
    name: str  # the measurement's name, unique in the table, e.g. "w1/3b/ours"
    what: str  # one line: what it measures
    kind: str  # the measurement kind (results.Measurement.kind)
    group: str  # rows of one group share a table in the report
    run: Callable[[Context], Outcome] = field(repr=False)  # how: (params, metrics)
    refs: Mapping[str, str] = field(default_factory=dict)  # role -> name of the row compared with
    needs: tuple[Need, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.what:
            raise ValueError("a benchmark row needs a name and a description")
        if self.name in self.refs.values():
            raise ValueError(f"row {self.name!r} refers to itself")


def index_rows(rows: list[Row]) -> dict[str, Row]:
    """Name -> row; each name defined once, every ref naming a row of the table."""
    table: dict[str, Row] = {}
    for row in rows:
        if row.name in table:
            raise ValueError(f"benchmark row {row.name!r} is defined twice")
        table[row.name] = row
    for row in rows:
        unknown = [ref for ref in row.refs.values() if ref not in table]
        if unknown:
            raise ValueError(f"row {row.name!r} refers to rows not in the table: {unknown}")
    return table


def with_refs(selected: list[str], table: Mapping[str, Row]) -> list[str]:
    """The selected rows in order, each preceded by the rows it refers to (transitively, once)."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"benchmark rows refer to each other in a circle: {' -> '.join(visiting + [name])}")
        visiting.append(name)
        for ref in table[name].refs.values():
            visit(ref)
        visiting.pop()
        order.append(name)

    for name in selected:
        if name not in table:
            raise ValueError(f"unknown benchmark row {name!r}")
        visit(name)
    return order
