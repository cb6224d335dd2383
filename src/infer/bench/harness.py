"""The harness that runs measurements one after another into a BenchRun.

Every measurement runs inside `Harness.measure`: a failure is caught and recorded (type,
message, the last traceback lines) and the run goes on; past the time budget the rest are
recorded as skipped. After each measurement the ratios are re-derived and the JSON file is
rewritten, so a run cut short still leaves every finished number on disk.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer.bench.analysis import derive_all
from infer.bench.batch_sweep import batch_sweep
from infer.bench.collectives import profile_collectives
from infer.bench.engine_runner import default_dtype, free_memory, run_engine
from infer.bench.peers import HFPeer, run_hf
from infer.bench.report import measurement_line
from infer.bench.results import BenchRun, Measurement, save_run
from infer.bench.roofline import copy_bandwidth, decode_roofline
from infer.engine.step_costs import weight_bytes
from infer.engine.step_costs import StepCostConfig, measure_model_costs
from infer.bench.theory import projection_table, tree_projection
from infer.bench.workloads import Workload
from infer.engine.loading import resolve_device
from infer.models.loader import load_model

Outcome = tuple[dict[str, Any], dict[str, Any]]  # (params, metrics)


PAIRED_MIN_REPEATS = 15  # rounds of a paired measurement: spikes of 1.5x hit a few runs in 5

@dataclass
class HarnessOptions:
    device: str = "auto"
    output_len: int | None = None  # every workload generates exactly this many tokens (quick runs)
    warmup_tokens: int | None = None  # cap on warm-up tokens per request; None = full length
    max_seconds: float | None = None  # time budget for the whole run
    cost_repeats: int = 30
    repeats: int = 3  # timed runs per engine measurement; the median one is reported
    paired_instances: int = 1  # engines of each kind in a paired measurement (see run_engine)
    with_hf: bool = True  # run the transformers peers
    model: str | None = None  # for the smoke / custom suites
    draft_model: str | None = None
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
                refs: Mapping[str, str | None] | None = None) -> Measurement:
        """Run `fn`, record its (params, metrics) or its error; never raises for `fn`'s errors."""
        existing = self.run.get(name)
        if existing is not None:  # shared by two suites of one run (bandwidth, costs)
            return existing
        m = Measurement(name, kind, group, refs={k: v for k, v in (refs or {}).items() if v})
        left = self.time_left()
        if left is not None and left <= 0:
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

    # -- measurement kinds -----------------------------------------------------------------
    def bandwidth(self, name: str = "bandwidth") -> Measurement:
        return self.measure(name, "bandwidth", "roofline", lambda: ({}, copy_bandwidth(self.device).to_dict()))

    def roofline(self, model: str, label: str, quantization: str | None = None) -> Measurement:
        """Batch-1 decode's roofline of `model` (its weights as `quantization` stores them)."""
        bw = self.bandwidth()

        def fn() -> Outcome:
            if not bw.ok:
                raise RuntimeError("no bandwidth measurement in this run")
            dtype = default_dtype(self.device)
            meta, _ = load_model(model, dtype=dtype, device="meta", load_format="dummy", quantization=quantization)
            roof = decode_roofline(weight_bytes(meta), bw.metrics["bytes_per_s"])
            return {"model": model, "dtype": dtype, "quantization": quantization}, roof.to_dict()

        name = f"roofline/{label}" + (f"-{quantization}" if quantization else "")
        return self.measure(name, "roofline", "roofline", fn, refs={"bandwidth": bw.name})

    def engine(self, name: str, group: str, workload: Workload, overrides: Mapping[str, Any],
               refs: Mapping[str, str | None] | None = None,
               paired_with: Mapping[str, Any] | None = None) -> Measurement:
        """An engine measurement; with `paired_with` (the baseline's overrides) its timed runs
        alternate with a baseline engine's (at least PAIRED_MIN_REPEATS rounds) and "x baseline"
        is the paired ratio."""
        wl = self.workload(workload)
        return self.measure(name, "engine", group, lambda: run_engine(
            wl, overrides, device=str(self.device), warmup_tokens=self.options.warmup_tokens,
            repeats=max(self.options.repeats, PAIRED_MIN_REPEATS) if paired_with is not None else self.options.repeats,
            paired_with=paired_with, paired_instances=self.options.paired_instances), refs)

    def collectives(self, name: str, group: str, workload: Workload, overrides: Mapping[str, Any]) -> Measurement:
        """Per-step time of a tensor-parallel engine's collectives, from a profile of its
        batch-1 decode steps (bench/collectives.py)."""
        wl = self.workload(workload)
        return self.measure(name, "collectives", group,
                            lambda: profile_collectives(wl, overrides, device=str(self.device)))

    def hf(self, name: str, group: str, workload: Workload, peer: HFPeer,
           refs: Mapping[str, str | None] | None = None) -> Measurement | None:
        if not self.options.with_hf:
            return None
        wl = self.workload(workload)
        return self.measure(name, "hf", group, lambda: run_hf(
            wl, peer, device=str(self.device), warmup_tokens=self.options.warmup_tokens), refs)

    def batch_sweep(self, name: str, group: str, overrides: Mapping[str, Any], batches: tuple[int, ...]) -> Measurement:
        """Decode step time against batch size on one engine (bench/batch_sweep.py)."""
        return self.measure(name, "batch_sweep", group,
                            lambda: batch_sweep(overrides, batches, device=str(self.device)))

    def spec_costs(self, name: str, target: str, draft: str | None, use_cuda_graphs: bool,
                   load_format: str = "auto", self_draft: bool = False,
                   draft_quantization: str | None = None) -> Measurement:
        def fn() -> Outcome:
            dtype = default_dtype(self.device)
            cfg = StepCostConfig(repeats=self.options.cost_repeats)
            t, _ = load_model(target, dtype=dtype, device=self.device, load_format=load_format)
            d = t if self_draft else (load_model(draft, dtype=dtype, device=self.device, load_format=load_format,
                                                 quantization=draft_quantization)[0] if draft else None)
            try:
                costs = measure_model_costs(t, d, use_cuda_graphs and self.device.type == "cuda", cfg)
            finally:
                del t, d
                free_memory()
            params = {"target": target, "draft": target if self_draft else draft, "dtype": dtype,
                      "draft_quantization": draft_quantization,
                      "use_cuda_graphs": use_cuda_graphs, "device": str(self.device),
                      "context_len": cfg.context_len, "max_seq_len": cfg.max_seq_len, "batch_size": 1}
            return params, costs.to_dict()

        return self.measure(name, "spec_costs", "spec-costs", fn)

    def projection(self, name: str, costs_name: str) -> Measurement:
        def fn() -> Outcome:
            costs = self.run.get(costs_name)
            if costs is None or not costs.ok or costs.metrics.get("c") is None:
                raise RuntimeError(f"projection needs the cost measurement {costs_name!r}, which did not succeed")
            c, verify = costs.metrics["c"], costs.metrics["verify_ratio"]
            paper = projection_table(c)
            measured = projection_table(c, verify_costs=verify) if len(verify) > max(paper.ks) else None
            trees = tree_projection(c, verify) if measured else None
            return ({"costs": costs_name, "c": c},
                    {"paper": paper.to_dict(), "measured_verify": measured.to_dict() if measured else None,
                     "trees": trees.to_dict() if trees else None})

        return self.measure(name, "projection", "spec-costs", fn, refs={"costs": costs_name})
