"""Time the linear layers' matmuls of a model shape on the GPU: cuBLAS (torch.matmul, bf16),
the Triton matmul (bf16 and FP8 weights) at its chosen config and at a sweep of configs,
and torch._scaled_mm (FP8 weights and activations) for larger M; each against the copy
bandwidth measured in the same run. Checks every Triton result against a float32 reference.

    python scripts/bench_matmul.py --shape llama-3.2-3b --rows 1 4 16 --sweep --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from graph_timing import graph_seconds  # noqa: E402
from infer_bench.roofline import copy_bandwidth  # noqa: E402
from infer.models.kernels.matmul import triton_linear  # noqa: E402
from infer.models.kernels.matmul_tiles import LinearConfig, SplitWorkspace, choose_config  # noqa: E402
from infer.models.layers.fp8 import quantize_fp8_rows  # noqa: E402
from infer.models.loading.loader import model_shapes  # noqa: E402


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a model shape."""
    c = model_shapes[name]
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def bench(fn, rep_ms: int = 40) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median") * 1e-3


def bench_graph(make_call, copies: int = 12, replays: int = 20) -> float:
    """Seconds per call when `copies` calls on distinct weight copies run back to back in
    one CUDA graph (as a decode step's layers do; the copies exceed the L2 cache)."""
    return graph_seconds([make_call(i) for i in range(copies)], replays)


def sweep_configs(m: int) -> list[LinearConfig]:
    out = []
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4,), (4,)):
        out.append(LinearConfig(block_m=16 if m <= 16 else 64, block_n=bn, block_k=bk, split_k=split,
                                num_warps=warps, num_stages=stages))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", nargs="+", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of configs at the first and last M")
    ap.add_argument("--large", type=int, nargs="*", default=[], help="larger M: Triton FP8 vs _scaled_mm vs bf16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev).bytes_per_s
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    shapes = layer_shapes(args.shape)
    for layer, (n, k) in shapes.items():
        if args.layers and layer not in args.layers:
            continue
        w = torch.randn(n, k, device=dev) * 0.02
        wb = w.to(torch.bfloat16)
        q, s = quantize_fp8_rows(w)
        ws = SplitWorkspace()
        copies = max(2, min(12, int(2e9 // (n * k * 2))))  # distinct weights: more than the L2 holds
        wbs = [wb] + [wb.clone() for _ in range(copies - 1)]
        qs = [q] + [q.clone() for _ in range(copies - 1)]
        workspaces = [SplitWorkspace() for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w.t()
            row = {"layer": layer, "n": n, "k": k, "m": m}
            row["cublas_s"] = bench_graph(lambda i: (lambda: torch.matmul(x, wbs[i].t())), copies)
            cfg = choose_config(m, n, k)
            for tag, weights, scale in (("bf16", wbs, None), ("fp8", qs, s)):
                y = triton_linear(x, weights[0], scale, cfg, ws)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                row[f"triton_{tag}_s"] = bench_graph(
                    lambda i, weights=weights, scale=scale: (lambda: triton_linear(x, weights[i], scale, cfg,
                                                                                   workspaces[i])), copies)
                row[f"triton_{tag}_err"] = err
                row["config"] = {f: getattr(cfg, f) for f in cfg.__slots__}
            nbytes = {"bf16": n * k * 2, "fp8": n * k}
            row["cublas_bw"] = nbytes["bf16"] / row["cublas_s"] / bw
            for tag in ("bf16", "fp8"):
                row[f"triton_{tag}_bw"] = nbytes[tag] / row[f"triton_{tag}_s"] / bw
            if args.sweep and m in (args.rows[0], args.rows[-1]):
                best = {}
                for tag, weight, scale in (("fp8", q, s),):
                    timed = []
                    weights = wbs if tag == "bf16" else qs
                    for c in sweep_configs(m):
                        try:
                            t = bench_graph(lambda i, weights=weights, scale=scale, c=c: (
                                lambda: triton_linear(x, weights[i], scale, c, workspaces[i])), copies, 8)
                        except Exception as exc:  # noqa: BLE001 - a config that does not compile
                            print("config failed", c, type(exc).__name__)
                            continue
                        timed.append((t, c))
                    t, c = min(timed, key=lambda tc: tc[0])
                    best[tag] = {"s": t, "bw": nbytes[tag] / t / bw, "config": {f: getattr(c, f) for f in c.__slots__}}
                row["best"] = best
            results.append(row)
            b = row.get("best", {})
            best_fp8 = f" | best fp8 {b['fp8']['bw']:.2f} {b['fp8']['config']}" if b else ""
            print(f"{layer:8s} n={n:6d} k={k:5d} m={m:3d} {row['config']} | cublas {row['cublas_bw']:.2f} | triton bf16 "
                  f"{row['triton_bf16_bw']:.2f} fp8 {row['triton_fp8_bw']:.2f} (err {row['triton_bf16_err']:.1e}/"
                  f"{row['triton_fp8_err']:.1e}){best_fp8}")
        for m in args.large:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"layer": layer, "n": n, "k": k, "m": m}
            row["cublas_s"] = bench(lambda: torch.matmul(x, wb.t()))
            cfg = choose_config(m, n, k)
            row["triton_fp8_s"] = bench(lambda: triton_linear(x, q, s, cfg, ws))
            qt = q.t()  # [K, N] column-major for _scaled_mm

            def scaled():
                xs = (x.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
                xq = (x.float() / xs).to(torch.float8_e4m3fn)
                return torch._scaled_mm(xq, qt, scale_a=xs, scale_b=s[None, :], out_dtype=torch.bfloat16)
            try:
                row["scaled_mm_s"] = bench(scaled)
            except Exception as exc:  # noqa: BLE001
                row["scaled_mm_error"] = repr(exc)[:200]
            results.append(row)
            print(f"{layer:8s} n={n:6d} k={k:5d} m={m:5d} | cublas bf16 {row['cublas_s'] * 1e6:.1f} us | triton fp8 "
                  f"{row['triton_fp8_s'] * 1e6:.1f} us | scaled_mm {row.get('scaled_mm_s', float('nan')) * 1e6:.1f} us")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "bandwidth": bw,
                                         "shape": args.shape, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
