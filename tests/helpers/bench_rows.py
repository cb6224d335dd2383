"""Which engine settings a suite's rows ask for, without running an engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from infer_bench import measures, suites
from infer_bench.harness import Harness, HarnessOptions
from infer_bench.results import BenchRun


def suite_overrides(monkeypatch: pytest.MonkeyPatch, suite: str,
                    pick: Callable[[str], bool]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the suite's row table, the engine overrides of each picked row): the harness runs the
    picked rows with `measures.run_engine` recording its overrides instead of measuring."""
    def recording(workload: Any, overrides: dict[str, Any], **kwargs: Any) -> tuple[dict[str, Any], dict]:
        return {"overrides": dict(overrides)}, {}

    monkeypatch.setattr(measures, "run_engine", recording)
    options = HarnessOptions(device="cpu", quiet=True)
    table, selected = suites.suite_rows(suite, options)
    run = BenchRun(suite)
    Harness(run, options).run_rows([n for n in selected if pick(n)], table)
    return table, {m.name: m.params["overrides"] for m in run.measurements}
