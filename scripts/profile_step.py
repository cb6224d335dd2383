"""Where a decode step's time goes on the GPU: wall time per step, GPU busy time (the union
of kernel intervals), the host gap between them, and the kernels by kind (matmul, the fused
rotary + KV write, attention, elementwise, copy), from torch.profiler over steady decode
steps of an engine. Kernel launches are counted per step and per decoder layer of the
target (a step's launches over its layer count: the lm_head, the sampler and the input
staging are spread over the layers, so a plain step's per-layer figure is a slight
overestimate; with speculation it counts the draft's and the verification's launches too).

    python scripts/profile_step.py --model dummy:llama-3.2-3b --batch 1 --steps 40 [--quantization fp8]
    python scripts/profile_step.py --model dummy:llama-3.2-3b --speculative-decoding --draft-model dummy:llama-3.2-1b
    python scripts/profile_step.py --prefill --batch 16 --prompt-len 2048 --max-seq-len 4096

With --prefill it profiles `batch` prompts from submission to their first tokens instead
(after one warm-up batch of the same shape); "steps" are then the engine steps that took.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from infer import SamplingParams  # noqa: E402
from infer.engine.args import add_engine_args, engine_config_from_args  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402

KINDS = (("matmul", ("gemm", "gemv", "_linear_kernel", "cutlass", "sm90", "splitk", "matmul",
                     "xmma")),
         ("rotary_kv_write", ("_rotary_write",)),
         ("attention", ("_split_attention", "_combine", "attention", "flash")),
         ("copy", ("copy", "index", "scatter", "gather", "memcpy", "memset", "fill")),
         ("elementwise", ("triton_", "elementwise", "vectorized", "reduce", "softmax", "cat", "mul", "add")))


def kind_of(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):  # Inductor's fusions (RMSNorm's name holds "_to_copy_"): norms and elementwise
        return "elementwise"
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def sync_sites(run) -> dict[str, int]:
    """Calls that synchronise the host with the GPU while `run()` runs, counted by the
    innermost frame of this repository's code that made them (torch's sync debug mode)."""
    sites: dict[str, int] = defaultdict(int)
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        ours = [f for f in traceback.extract_stack() if "/infer/" in f.filename]
        where = f"{ours[-1].filename.split('/infer/')[-1]}:{ours[-1].lineno} {ours[-1].line}" if ours else filename
        sites[where] += 1

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def host_top(run, steps: int, n: int) -> dict[str, float]:
    """The n functions with the most own host time while `run()` runs, in ms a step."""
    prof = cProfile.Profile()
    prof.runcall(run)
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim, own s, cumulative s, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return {f"{Path(f).name}:{line} {name} x{calls / steps:.0f}": own / steps * 1e3
            for (f, line, name), (calls, _, own, _, _) in top}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prefill", action="store_true", help="profile prompts to their first tokens")
    ap.add_argument("--host-top", type=int, default=0, metavar="N",
                    help="also list the N Python functions taking the most host time a step (cProfile, own time)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="also list the host-device synchronisations of one profiled pass (where in our code)")
    add_engine_args(ap)
    ap.set_defaults(model="dummy:llama-3.2-3b", device="cuda", max_seq_len=1024)
    args = ap.parse_args()
    args.max_batch_size = max(args.batch, 1)
    engine = Engine(engine_config_from_args(args))
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)

    def submit(max_tokens: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [engine.add_request(torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params)
                for _ in range(args.batch)]

    def prefill_steps(reqs: list) -> int:
        steps = 0
        while not all(r.is_finished for r in reqs):
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        return steps

    if args.prefill:
        prefill_steps(submit(1))  # warm-up
        start = time.perf_counter()
        args.steps = prefill_steps(reqs := submit(1))
        wall = (time.perf_counter() - start) / args.steps
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            prefill_steps(reqs := submit(1))
    else:
        reqs = submit(engine.resolved.scheduler.max_seq_len - args.prompt_len - 16)
        while any(r.num_computed_tokens < args.prompt_len for r in reqs):  # every prompt prefilled
            engine.step()
        for _ in range(8):  # warm: every request decoding, its bucket's graphs replayed
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
    syncs = sync_sites(lambda: prefill_steps(submit(1)) if args.prefill else [engine.step() for _ in range(args.steps)]
                       ) if args.sync_debug else None
    host = host_top(lambda: [engine.step() for _ in range(args.steps)], args.steps, args.host_top) \
        if args.host_top and not args.prefill else None
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    intervals = [(e.time_range.start, e.time_range.end) for e in events]
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / args.steps / 1e3  # ms per step
    busy = busy_time(intervals) / args.steps / 1e3
    by_kind: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    names: dict[str, float] = defaultdict(float)
    for e in events:
        k = kind_of(e.name)
        by_kind[k] += (e.time_range.end - e.time_range.start) / args.steps / 1e3
        counts[k] += 1
        names[e.name[:90]] += (e.time_range.end - e.time_range.start) / args.steps / 1e3
    tokens = sum(len(r.output_token_ids) for r in reqs)
    layers = engine.runner.model.config.num_hidden_layers
    per_step = {k: v / args.steps for k, v in counts.items()}
    out = {"model": args.model, "batch": args.batch, "prefill": args.prefill, "prompt_len": args.prompt_len,
           "quantization": args.quantization,
           "speculative": args.use_speculative_decoding, "wall_ms_per_step": wall * 1e3,
           "profiled_span_ms_per_step": span, "gpu_busy_ms_per_step": busy, "host_gap_ms_per_step": span - busy,
           "kernels_ms_per_step": dict(by_kind), "kernels_per_step": per_step,
           "kernels_per_step_total": sum(per_step.values()), "target_layers": layers,
           "kernels_per_layer": sum(per_step.values()) / layers,
           "kernels_per_layer_by_kind": {k: v / layers for k, v in per_step.items()},
           "top_kernels_ms": dict(sorted(names.items(), key=lambda kv: -kv[1])[:15]), "tokens": tokens,
           "sync_sites": syncs, "host_top_ms_per_step": host,
           "rounds_followed": None if engine.runner.stats is None else engine.runner.stats.followed}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    for r in reqs:
        if not r.is_finished:
            engine.abort(r.request_id)


if __name__ == "__main__":
    main()
