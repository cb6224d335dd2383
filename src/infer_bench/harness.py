"""The harness that runs benchmark rows one after another into a BenchRun.

Each row runs after the rows it refers to. A row whose needs are unmet is recorded as
skipped with a hint; a failure is recorded (type, message, the last traceback lines) and
the run goes on; past the time budget the rest are skipped. After each row the ratios are
re-derived and the JSON file is rewritten, so a run cut short keeps every finished number.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from infer_bench.analysis import derive_all
from infer_bench.engine_runner import free_memory
from infer_bench.report import measurement_line
from infer_bench.results import BenchRun, Measurement, save_run
from infer_bench.rows import HarnessOptions, Outcome, Row, with_refs
from infer_bench.workloads import Workload
from infer.engine.loading import resolve_device

__all__ = ["Harness", "HarnessOptions"]


class Harness:
    def __init__(self, run: BenchRun, options: HarnessOptions, out_path: Path | None = None) -> None:
        self.run, self.options, self.out_path = run, options, out_path
        self.device = resolve_device(options.device)
        self.start = time.monotonic()

    # -- bookkeeping -----------------------------------------------------------------------
    def time_left(self) -> float | None:
        if self.options.max_seconds is None:
            return None
        return self.options.max_seconds - (time.monotonic() - self.start)

    def measure(self, name: str, kind: str, group: str, fn: Callable[[], Outcome],
                refs: Mapping[str, str | None] | None = None, skip: str | None = None) -> Measurement:
        """Run `fn`, record its (params, metrics) or its error; never raises for `fn`'s errors.
        `skip`: record the measurement as skipped for this reason instead."""
        m = Measurement(name, kind, group, refs={k: v for k, v in (refs or {}).items() if v})
        left = self.time_left()
        if skip is not None:
            m.status, m.error = "skipped", skip
        elif left is not None and left <= 0:
            m.status, m.error = "skipped", "time budget (--max-seconds) used up"
        else:
            t0 = time.perf_counter()
            try:
                m.params, m.metrics = fn()
            except Exception as exc:  # a failing measurement must not end the run
                m.status = "error"
                m.error = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc(limit=-4))[-2000:]
                free_memory()
            m.elapsed_s = time.perf_counter() - t0
        self.run.add(m)
        derive_all(self.run)
        if self.out_path is not None:
            save_run(self.run, self.out_path)
        if not self.options.quiet:
            print(measurement_line(m), flush=True)
        return m

    def workload(self, workload: Workload) -> Workload:
        n = self.options.output_len
        return workload if n is None else workload.with_output_len(n)

    def run_rows(self, selected: Sequence[str], table: Mapping[str, Row]) -> list[Measurement]:
        """Run the `selected` rows of `table` (each after the rows it refers to), in order."""
        order = with_refs(list(selected), table)
        out = []
        for i, name in enumerate(order, 1):
            if self.run.get(name) is not None:  # already measured in this run
                continue
            row = table[name]
            unmet = next((text for text in (need.missing(self) for need in row.needs) if text), None)
            if unmet is None and not self.options.quiet:
                print(f"[{i}/{len(order)}] {name}: {row.what} ...", file=sys.stderr, flush=True)
            out.append(self.measure(name, row.kind, row.group, lambda r=row: r.run(self), row.refs, skip=unmet))
        return out
