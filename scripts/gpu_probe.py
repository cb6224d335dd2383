"""Quick GPU probe: batch-1 decode step time of a dummy Llama shape, eager vs CUDA graphs vs
graphs + compiled kernels, against the copy-bandwidth roofline measured in the same run.
Usage (GPU machine): PYTHONPATH=src python scripts/gpu_probe.py --shape llama-3.2-3b [--profile]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from infer import SamplingParams
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine


def copy_bandwidth(nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); dst.copy_(src); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_rate(engine: Engine, prompt_len: int = 128, new: int = 256) -> float:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ids = list(range(1000, 1000 + prompt_len))
    engine.add_request(ids, params)  # warm-up
    while engine.has_unfinished():
        engine.step()
    req = engine.add_request(ids, params)
    engine.step()  # prefill + first token
    torch.cuda.synchronize()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return (len(req.output_token_ids) - 1) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--spec", action="store_true", help="also speculative runs (1B-shape draft, self draft)")
    ap.add_argument("--variants", default="eager,graphs,graphs+compile")
    args = ap.parse_args()
    bw = copy_bandwidth()
    results = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "copy_bandwidth_GBps": bw / 1e9}
    fast = dict(use_cuda_graphs=True, compile_kernels=True)
    variants = [("eager", dict(use_cuda_graphs=False, compile_kernels=False)),
                ("graphs", dict(use_cuda_graphs=True, compile_kernels=False)),
                ("graphs+compile", fast)]
    variants = [v for v in variants if v[0] in args.variants.split(",")]
    if args.spec:
        spec = dict(use_speculative_decoding=True, spec_length=5, **fast)
        variants += [("spec-1b-fixed5", dict(draft_model="dummy:llama-3.2-1b", **spec)),
                     ("spec-1b-adaptive", dict(draft_model="dummy:llama-3.2-1b", spec_policy="adaptive", **spec)),
                     ("spec-self-fixed5", dict(draft_model=f"dummy:{args.shape}", **spec))]
    for name, kw in variants:
        t0 = time.perf_counter()
        cfg = EngineConfig(model=f"dummy:{args.shape}", load_format="dummy", dtype="bfloat16", device="cuda",
                           max_batch_size=1, max_seq_len=512, kv_cache_backend="contiguous",
                           enable_prefix_caching=False, **kw)
        engine = Engine(cfg)
        setup = time.perf_counter() - t0
        wb = weight_bytes(engine.models.target)
        rate = decode_rate(engine)
        roof = bw / wb
        stats = getattr(engine.runner, "stats", None)
        if stats is not None:
            results.setdefault("spec", {})[name] = {"acceptance": stats.acceptance_rate,
                                                     "mean_accepted_length": stats.mean_accepted_length}
        results[name] = {"tokens_per_s": rate, "step_ms": 1e3 / rate, "roofline_tokens_per_s": roof,
                         "fraction_of_roofline": rate / roof, "setup_s": setup, "weight_GB": wb / 1e9}
        print(name, json.dumps(results[name]), flush=True)
        if args.profile and name != "eager":
            from torch.profiler import ProfilerActivity, profile
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            engine.add_request(list(range(100, 228)), params)
            engine.step()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                while engine.has_unfinished():
                    engine.step()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        del engine
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
