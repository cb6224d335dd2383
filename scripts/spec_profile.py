"""Where a speculative round's time goes on the GPU machine: wall time per token, GPU busy
time per token (torch.profiler, kernels only) and the host's hottest Python functions
(cProfile), for plain decoding and speculation on the same model.

    PYTHONPATH=src python scripts/spec_profile.py --out DIR [--temperature 0 1] [--k 5]

Writes DIR/profile-<variant>.txt per variant and prints one summary line each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


def _generate(engine: Engine, temperature: float, tokens: int) -> int:
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    req = engine.add_request(list(range(100, 228)), params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert len(req.output_token_ids) == tokens
    return steps


def step_log(engine: Engine, temperature: float, tokens: int) -> str:
    """One generation, every step timed and filed under (chosen K, longest draft)."""
    runner = engine.runner
    seen: dict[str, int] = {}
    choose, propose = runner.policy.choose, runner.proposer.propose

    def chosen(*args):  # noqa: ANN002, ANN202
        ks = choose(*args)
        seen["k"], seen["drafted"] = max(ks), 0
        return ks

    def proposed(requests, ks):  # noqa: ANN001, ANN202
        drafts = propose(requests, ks)
        seen["drafted"] = max(len(d.token_ids) for d in drafts)
        return drafts

    runner.policy.choose, runner.proposer.propose = chosen, proposed
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    engine.add_request(list(range(100, 228)), params)
    while engine.has_unfinished():
        seen.clear()
        start = time.perf_counter()
        engine.step()
        groups[(seen.get("k", -1), seen.get("drafted", -1))].append((time.perf_counter() - start) * 1e3)
    runner.policy.choose, runner.proposer.propose = choose, propose
    lines = ["(chosen K, drafted) -> steps, mean ms (K -1: prefill)"]
    lines += [f"  {key}: {len(v)} steps, {sum(v) / len(v):.3f} ms" for key, v in sorted(groups.items())]
    return "\n".join(lines)


def profile_variant(name: str, cfg: EngineConfig, temperature: float, tokens: int, out: Path) -> str:
    engine = Engine(cfg)
    _generate(engine, temperature, tokens)  # warm-up: graphs, compiles, allocator
    steps_text = step_log(engine, temperature, tokens) if cfg.use_speculative_decoding else ""
    torch.cuda.synchronize()
    start = time.perf_counter()
    steps = _generate(engine, temperature, tokens)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    prof = cProfile.Profile()
    prof.enable()
    _generate(engine, temperature, tokens)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        _generate(engine, temperature, tokens)
        torch.cuda.synchronize()
    events = tp.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    stats = getattr(engine.runner, "stats", None)
    line = (f"{name}: {tokens / wall:.0f} tok/s, wall {wall / tokens * 1e3:.3f} ms/token, "
            f"GPU busy {gpu_us / tokens / 1e3:.3f} ms/token ({gpu_us / (wall * 1e6):.0%} of wall), "
            f"{kernels / tokens:.0f} kernels/token, {steps} steps")
    if stats is not None:
        line += f", acceptance {stats.acceptance_rate:.3f}"
    body = [line, steps_text, "", "== torch.profiler, by self device time ==",
            events.table(sort_by="self_device_time_total", row_limit=25),
            "== torch.profiler, by self CPU time ==", events.table(sort_by="self_cpu_time_total", row_limit=25),
            "== cProfile (one generation), by own time ==", text.getvalue()]
    (out / f"profile-{name}.txt").write_text("\n".join(body))
    del engine
    torch.cuda.empty_cache()
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--only", nargs="*", help="variants whose name contains one of these")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=torch.cuda.is_available(), max_batch_size=1, max_seq_len=512)
    for t in args.temperature:
        variants = {
            "plain": EngineConfig(**base),
            f"draft-k{args.k}": EngineConfig(**base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT),
                                             spec_length=args.k),
            f"ngram-k{args.k}": EngineConfig(**base, use_speculative_decoding=True, speculative_method="ngram",
                                             spec_length=args.k),
            "draft-adaptive": EngineConfig(**base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT),
                                           spec_length=args.k, spec_policy="adaptive"),
            "ngram-adaptive": EngineConfig(**base, use_speculative_decoding=True, speculative_method="ngram",
                                           spec_length=args.k, spec_policy="adaptive"),
        }
        for name, cfg in variants.items():
            if args.only and not any(o in name for o in args.only):
                continue
            print(profile_variant(f"{name}-t{t:g}", cfg, t, args.tokens, args.out), flush=True)


if __name__ == "__main__":
    main()
