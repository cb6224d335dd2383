"""Where a tensor-parallel decode step's time goes: its collectives, from a profile.

`profile_collectives` profiles decode steps of the workload's first request alone with
torch.profiler on rank 0 and sums the device time of NCCL's kernels per step, all-reduces
apart from all-gathers. A collective's kernel time includes waiting for the slower rank:
that is what the step pays.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from infer_bench.engine_runner import engine_config, warmup
from infer_bench.workloads import Workload, build_requests
from infer.engine.engine import Engine
from infer.timing import synchronize

PROFILED_STEPS = 64
_KINDS = (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("broadcast", "broadcast"))


def collective_kind(kernel_name: str) -> str | None:
    """"all_reduce" / "all_gather" / "broadcast" for an NCCL kernel's name (and "all_reduce"
    for the one-shot all-reduce kernel, distributed/one_shot.py), "other_collective" for
    another NCCL kernel, None for any other kernel."""
    name = kernel_name.lower()
    if "one_shot_all_reduce" in name:
        return "all_reduce"
    if "nccl" not in name:
        return None
    return next((kind for key, kind in _KINDS if key in name), "other_collective")


def summarize_kernels(kernels: Iterable[tuple[str, float]], steps: int, wall_s: float) -> dict[str, Any]:
    """Per-step milliseconds by collective kind, from (kernel name, device microseconds)."""
    total_us, by_kind = 0.0, {"all_reduce": 0.0, "all_gather": 0.0, "broadcast": 0.0, "other_collective": 0.0}
    calls = dict.fromkeys(by_kind, 0)
    count = 0
    for name, us in kernels:
        count += 1
        total_us += us
        kind = collective_kind(name)
        if kind is not None:
            by_kind[kind] += us
            calls[kind] += 1
    step_ms = wall_s * 1e3 / steps
    out: dict[str, Any] = {"steps": steps, "kernels": count, "step_ms": step_ms,
                           "gpu_busy_ms_per_step": total_us / 1e3 / steps}
    for kind, us in by_kind.items():
        out[f"{kind}_ms_per_step"] = us / 1e3 / steps
        out[f"{kind}_calls_per_step"] = calls[kind] / steps
    collectives_ms = sum(by_kind.values()) / 1e3 / steps
    out["collectives_ms_per_step"] = collectives_ms
    out["all_reduce_share_of_step"] = out["all_reduce_ms_per_step"] / step_ms
    out["collectives_share_of_step"] = collectives_ms / step_ms
    busy = out["gpu_busy_ms_per_step"]
    out["collectives_share_of_gpu_time"] = collectives_ms / busy if busy else None
    return out


def profile_collectives(workload: Workload, overrides: Mapping[str, Any], *, device: str = "auto",
                        steps: int = PROFILED_STEPS) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, metrics): see the module docstring. Needs a CUDA device."""
    config = engine_config(workload, overrides, device)
    engine = Engine(config)
    try:
        if engine.device.type != "cuda":
            raise RuntimeError("the collectives profile needs CUDA devices (NCCL kernels)")
        prompts = build_requests(workload, engine.vocab_size, engine.tokenizer)
        warmup(engine, workload, prompts, None)
        spec = prompts.requests[0]
        steps = max(1, min(steps, spec.max_tokens - 8))
        request = engine.add_request(spec.prompt_ids, workload.sampling_params(0, spec.max_tokens), "profiled")
        while len(request.output_token_ids) < 4:  # prefill, then a few steady decode steps
            engine.step()
        synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            synchronize(engine.device)
            wall = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        kernels = [(e.name, e.device_time_total) for e in prof.events() if e.device_type == DeviceType.CUDA]
        metrics = summarize_kernels(kernels, steps, wall)
        if not metrics["kernels"]:
            raise RuntimeError("the profiler saw no GPU kernels")
        params = {"workload": workload.to_dict(), "overrides": dict(overrides), "batch_size": 1}
        return params, metrics
    finally:
        engine.close()
        del engine
        torch.cuda.empty_cache()
