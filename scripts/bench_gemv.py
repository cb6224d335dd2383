"""Time the few-row matmul (models/kernels/gemv.py) on every linear matrix of the Llama 3.2
1B and 3B shapes at 1-16 rows, bf16, FP8 and integer (int4 / int8, groups of 128) weights,
against cuBLAS (F.linear, bf16) and the Triton matmul (models/kernels/matmul.py; not for
integer weights), each as a fraction of the device-to-device copy bandwidth measured in the
same run (integer weights: their codes, scales and offsets counted).

Every timing is inside a CUDA graph of 20 calls on 20 distinct copies of the weight (more
than the L2 cache holds, as a decode step's layers are), replayed many times: the median
replay over 20. For each matrix, row count and weight kind the script searches the
candidate configurations (`candidate_configs`, with the K splits of `with_splits`) twice:
the plain matmul, and the layer's fused form in a decode step
(RMSNorm before qkv, gate_up and lm_head; the residual add after o; SwiGLU before and the
residual add after down). It checks each output against the unfused layers, prints the
best of each and the default configuration's time, and lists the fused form's best as
`gemv_tiles.CONFIG_TABLE` entries (`--table` merges them into `gemv_tiles.json`, the table
the engine reads). Kernels compile first in a pool of processes (Triton's
disk cache hands them to this one).

    python scripts/bench_gemv.py --out gemv.json [--models llama-3.2-1b] [--rows 1 16] [--dtypes fp8 int4]
        [--table src/infer/models/kernels/gemv_tiles.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from graph_timing import graph_seconds  # noqa: E402
from infer_bench.roofline import copy_bandwidth  # noqa: E402
from infer.models.kernels.dequant import dequantize_on_device  # noqa: E402
from infer.models.kernels.gemv import gemv  # noqa: E402
from infer.models.kernels.gemv_tiles import (  # noqa: E402
    NUM_SMS, TABLE_FILE, WEIGHT_KINDS, GemvConfig, default_config, row_bucket)
from infer.models.kernels.matmul import triton_linear  # noqa: E402
from infer.models.kernels.matmul_tiles import SplitWorkspace, choose_config  # noqa: E402
from infer.models.layers.fp8 import quantize_fp8_rows  # noqa: E402
from infer.models.layers.int_quant import IntLayout, IntScales, quantize_rtn  # noqa: E402
from infer.models.layers.mlp import silu_mul  # noqa: E402
from infer.models.layers.norms import rmsnorm  # noqa: E402
from infer.models.loading.loader import model_shapes  # noqa: E402

CALLS = 20  # calls per graph, each on its own weight copy
FUSION = {"qkv": ("norm",), "o": ("residual",), "gate_up": ("norm",), "down": ("swiglu", "residual"),
          "lm_head": ("norm",)}  # what surrounds each matmul in a decoder step


# The tiles the benchmark searches per row bucket: (block_n, block_k, dot, num_warps, num_stages).
# FMA tiles read 16 bytes a thread per row; dot tiles need 16 rows and 16 columns at least.
CANDIDATES: dict[int, tuple[tuple[int, int, bool, int, int], ...]] = {
    1: ((2, 2048, False, 4, 1), (4, 2048, False, 4, 1), (4, 1024, False, 4, 1), (8, 1024, False, 4, 1),
        (4, 512, False, 4, 1), (8, 512, False, 4, 1), (16, 512, False, 8, 1),
        (4, 512, False, 4, 3), (8, 512, False, 4, 3), (16, 512, False, 4, 3)),
    2: ((2, 2048, False, 4, 1), (4, 1024, False, 4, 1), (4, 512, False, 4, 1), (8, 512, False, 4, 1),
        (4, 512, False, 4, 3), (8, 512, False, 4, 3), (8, 256, False, 4, 3)),
    4: ((4, 512, False, 4, 1), (4, 512, False, 4, 3), (8, 256, False, 4, 3), (8, 512, False, 8, 3),
        (16, 128, True, 4, 3), (32, 128, True, 4, 3), (32, 256, True, 4, 3)),
    8: ((4, 256, False, 4, 3), (8, 256, False, 8, 3), (4, 512, False, 8, 3), (32, 128, True, 4, 3),
        (64, 128, True, 4, 3), (32, 256, True, 4, 3)),
    16: ((4, 256, False, 8, 3), (8, 128, False, 8, 3), (32, 128, True, 4, 3), (64, 128, True, 4, 3),
         (32, 256, True, 4, 3), (64, 256, True, 4, 3)),
}


# Integer codes (one group a step: block_k <= 128) take tall tiles, K split to fill the GPU; same fields.
INT_CANDIDATES: dict[bool, tuple[tuple[int, int, bool, int, int], ...]] = {
    False: ((32, 128, False, 4, 3), (64, 128, False, 4, 3), (128, 128, False, 4, 3), (128, 64, False, 4, 3),
            (64, 128, False, 4, 1), (128, 128, False, 4, 1), (128, 128, False, 8, 1), (256, 128, False, 4, 1),
            (256, 128, False, 8, 1), (256, 128, False, 8, 2), (512, 128, False, 8, 1)),
    True: ((64, 128, True, 4, 3), (128, 128, True, 4, 3), (128, 128, True, 4, 1), (64, 128, True, 4, 1))}


def candidate_configs(bucket: int, kind: str = "bf16") -> list[GemvConfig]:
    """The tiles the benchmark searches for a row bucket and weight kind (without K splits)."""
    if bucket not in CANDIDATES:
        raise ValueError(f"row bucket must be one of {sorted(CANDIDATES)}, got {bucket}")
    tiles = INT_CANDIDATES[bucket > 2] if kind in ("int4", "int8") else CANDIDATES[bucket]
    return [GemvConfig(block_n=bn, block_k=bk, dot=dot, num_warps=warps, num_stages=stages)
            for bn, bk, dot, warps, stages in tiles]


def with_splits(cfg: GemvConfig, n: int, k: int) -> list[GemvConfig]:
    """`cfg` unsplit, and with each power-of-two split_k giving 1..8 programs per multiprocessor
    (each split keeping two K steps at least)."""
    out = [cfg]
    blocks = -(-n // cfg.block_n)
    k_steps = -(-k // cfg.block_k)
    split = 2
    while blocks * split <= 8 * NUM_SMS and split <= k_steps // 2:
        if blocks * split >= NUM_SMS:
            out.append(replace(cfg, split_k=split))
        split *= 2
    return out


def write_table(found: dict[tuple[int, int, int, str], tuple[str, GemvConfig]], device: str,
                path: Path = TABLE_FILE) -> None:
    """Merge measured configurations ((N, K, bucket, kind) -> (matrix, config)) into a table file,
    recording `device`."""
    data = json.loads(path.read_text(encoding="utf-8"))
    entries = {(e["n"], e["k"], e["rows"], e["kind"]): e for e in data["entries"]}
    for (n, k, rows, kind), (matrix, c) in found.items():
        entries[(n, k, rows, kind)] = {"matrix": matrix, "n": n, "k": k, "rows": rows, "kind": kind, "config":
                                       [c.block_n, c.block_k, c.split_k, c.dot, c.num_warps, c.num_stages]}
    data["device"] = device
    ordered = sorted(entries.values(), key=lambda e: (e["kind"], e["matrix"], e["rows"]))
    head = "".join(f" {json.dumps(key)}: {json.dumps(value)},\n" for key, value in data.items() if key != "entries")
    path.write_text("{\n" + head + ' "entries": [\n' + ",\n".join("  " + json.dumps(e) for e in ordered)
                    + "\n ]\n}\n", encoding="utf-8")


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear matrix of a model shape."""
    c = model_shapes[name]
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def fused_inputs(flags: tuple[str, ...], m: int, n: int, k: int, dev: torch.device) -> dict[str, object]:
    """Keyword arguments of `gemv` for a fused call: the norm weight, the SwiGLU flag, the residual."""
    out: dict[str, object] = {}
    if "norm" in flags:
        out["norm_weight"] = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
    if "swiglu" in flags:
        out["swiglu_input"] = True
    if "residual" in flags:
        out["residual"] = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    return out


def unfused_reference(x: torch.Tensor, dense: torch.Tensor, extra: dict[str, object]) -> torch.Tensor:
    """The unfused layers' result in float32: SwiGLU, RMSNorm, the matmul in float32 on the
    dense weight rounded to x's dtype, the residual add."""
    a = silu_mul(x) if extra.get("swiglu_input") else x
    norm_weight = extra.get("norm_weight")
    a = rmsnorm(a, norm_weight, 1e-5) if isinstance(norm_weight, torch.Tensor) else a
    y = (a.float() @ dense.t()).to(x.dtype)
    residual = extra.get("residual")
    return (residual + y if isinstance(residual, torch.Tensor) else y).float()


def stored(kind: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | IntScales | None, torch.Tensor, int]:
    """W [N, K] stored as `kind`: (what gemv reads, its scale, the dense float32 value, bytes)."""
    n, k = w.shape
    if kind == "fp8":
        q, s = quantize_fp8_rows(w)
        return q, s, q.float() * s[:, None], n * k + 4 * n
    if kind in ("int4", "int8"):
        layout = IntLayout(int(kind[3:]), 128)
        packed, scales, offsets = quantize_rtn(w, layout, torch.bfloat16)
        ints = IntScales(scales, offsets, layout)
        return packed, ints, dequantize_on_device(packed, ints).float(), packed.numel() + 4 * scales.numel()
    wb = w.to(torch.bfloat16)
    return wb, None, wb.float(), 2 * n * k


def _compile(job: tuple[int, str, dict, tuple[str, ...], int]) -> str:
    """Pool worker: run gemv once at this configuration so that Triton compiles it into its
    disk cache (256 rows of W; the launch parameters that key the cache match the real
    ones, K too where it sets the RMS pass's step)."""
    bucket, kind, cfg_fields, flags, k = job
    cfg = GemvConfig(**cfg_fields)
    dev = torch.device("cuda")
    n = 256
    x = torch.randn(bucket, 2 * k if "swiglu" in flags else k, device=dev, dtype=torch.bfloat16)
    w, s, _, _ = stored(kind, torch.randn(n, k, device=dev))
    try:
        gemv(x, w, s, config=cfg, **fused_inputs(flags, bucket, n, k, dev))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 - reported; the config is then skipped when timed
        return f"{cfg} {kind} {flags}: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(pool: multiprocessing.pool.Pool, jobs: set[tuple[int, str, tuple, tuple[str, ...], int]]) -> None:
    t0 = time.perf_counter()
    errors = [e for e in pool.map(_compile, [(b, f, dict(c), fl, k) for b, f, c, fl, k in sorted(jobs, key=str)])
              if e]
    for e in errors:
        print("compile failed:", e)
    print(f"compiled {len(jobs)} kernel variants in {time.perf_counter() - t0:.0f} s", flush=True)


def search_space(n: int, k: int, m: int, kind: str) -> list[GemvConfig]:
    """Every candidate tile of m's row bucket and the weight kind with each of its K splits for this shape."""
    return list(dict.fromkeys(s for c in candidate_configs(row_bucket(m), kind) for s in with_splits(c, n, k)))


def short(cfg: GemvConfig) -> str:
    return (f"{'dot' if cfg.dot else 'fma'} {cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} "
            f"st{cfg.num_stages}")


class Bench:
    def __init__(self, args: argparse.Namespace, bandwidth: float, start: float) -> None:
        self.args, self.bw, self.dev, self.start = args, bandwidth, torch.device("cuda"), start

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def weights(self, n: int, k: int) -> dict[str, tuple[list[torch.Tensor], torch.Tensor | IntScales | None,
                                                         torch.Tensor, int]]:
        """Per weight kind: CALLS copies of a random weight stored as that kind, its scale,
        its dense float32 value (for the reference) and its bytes."""
        w = torch.randn(n, k, device=self.dev) * k ** -0.5
        out = {}
        for kind in sorted(set(self.args.dtypes) | {"bf16"}):
            q, s, dense, nbytes = stored(kind, w)
            out[kind] = ([q] + [q.clone() for _ in range(CALLS - 1)], s, dense, nbytes)
        return out

    def search(self, x: torch.Tensor, ws: list[torch.Tensor], s: torch.Tensor | IntScales | None,
               space: list[GemvConfig],
               ref: torch.Tensor, extra: dict[str, object]) -> list[tuple[float, GemvConfig, float]]:
        """(seconds per call, config, relative error) of each config that runs and is right; each
        weight copy keeps its split-K counters in its own workspace, as a layer does."""
        timed = []
        spaces = [SplitWorkspace() for _ in ws]
        for cfg in space:
            try:
                err = ((gemv(x, ws[0], s, config=cfg, workspace=spaces[0], **extra).float() - ref).norm()
                       / ref.norm()).item()
                t = graph_seconds([lambda w=w, sp=sp: gemv(x, w, s, config=cfg, workspace=sp, **extra)
                                   for w, sp in zip(ws, spaces)], self.args.replays)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch
                print(f"  {short(cfg)} {sorted(extra)} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if not err < 1e-2:
                print(f"  {short(cfg)} {sorted(extra)} WRONG: relative error {err:.2e}")
                continue
            timed.append((t, cfg, err))
        return timed

    def layer(self, model: str, name: str, n: int, k: int) -> list[dict]:
        rows = []
        weights = self.weights(n, k)
        workspaces = [SplitWorkspace() for _ in range(CALLS)]
        for m in self.args.rows:
            x = torch.randn(m, k, device=self.dev, dtype=torch.bfloat16)
            xf = torch.randn(m, 2 * k if "swiglu" in FUSION[name] else k, device=self.dev, dtype=torch.bfloat16)
            extra = fused_inputs(FUSION[name], m, n, k, self.dev)
            cublas = graph_seconds([lambda w=w: F.linear(x, w) for w in weights["bf16"][0]], self.args.replays)
            for dtype in self.args.dtypes:
                ws, s, dense, nbytes = weights[dtype]
                lin_cfg = choose_config(m, n, k)
                tl_s = float("nan") if isinstance(s, IntScales) else graph_seconds(
                    [lambda w=w, ws_=wsp: triton_linear(x, w, s, lin_cfg, ws_) for w, wsp in zip(ws, workspaces)],
                    self.args.replays)
                default = default_config(n, k, row_bucket(m), dtype)
                space = [default] if self.over_budget() else list(dict.fromkeys(search_space(n, k, m, dtype) + [default]))
                plain = self.search(x, ws, s, space, unfused_reference(x, dense, {}), {})
                fused = self.search(xf, ws, s, space, unfused_reference(xf, dense, extra), extra)
                if not plain or not fused:
                    print(f"{model} {name} m={m} {dtype}: no configuration ran")
                    continue
                (t, best, err), (tf, best_f, _) = min(plain, key=lambda r: r[0]), min(fused, key=lambda r: r[0])
                t_def = next((tc for tc, c, _ in plain if c == default), float("nan"))
                row = {"model": model, "layer": name, "n": n, "k": k, "m": m, "dtype": dtype, "bytes": nbytes,
                       "gemv_s": t, "gemv_bw": nbytes / t / self.bw, "gemv_err": err, "config": asdict(best),
                       "fused": "+".join(FUSION[name]), "fused_s": tf, "fused_bw": nbytes / tf / self.bw,
                       "fused_config": asdict(best_f), "default_config": asdict(default), "default_s": t_def,
                       "default_bw": nbytes / t_def / self.bw, "triton_linear_s": tl_s,
                       "triton_linear_bw": nbytes / tl_s / self.bw, "cublas_bf16_s": cublas,
                       "cublas_bf16_bw": n * k * 2 / cublas / self.bw, "searched": len(space),
                       "candidates": [{"config": asdict(c), "s": tc, "err": e} for tc, c, e in plain],
                       "fused_candidates": [{"config": asdict(c), "s": tc, "err": e} for tc, c, e in fused]}
                rows.append(row)
                print(f"{model:13s} {name:8s} {n:6d}x{k:<5d} m={m:2d} {dtype:4s} | gemv {row['gemv_bw']:.2f} "
                      f"[{short(best)}] fused {row['fused_bw']:.2f} [{short(best_f)}] default {row['default_bw']:.2f}"
                      f" | triton_linear {row['triton_linear_bw']:.2f} | cublas bf16 {row['cublas_bf16_bw']:.2f} "
                      f"({cublas * 1e6:.1f} us) | err {err:.1e}", flush=True)
        del weights
        torch.cuda.empty_cache()
        return rows


def print_table(rows: list[dict]) -> None:
    print("\nfraction of copy bandwidth (weight bytes / time / copy bandwidth), in-graph, median of replays")
    print(f"{'model':13s} {'layer':8s} {'m':>2s} | {'bf16 gemv':>9s} {'fused':>5s} {'cuBLAS':>6s} {'tri_lin':>7s} | "
          f"{'fp8 gemv':>8s} {'fused':>5s} {'tri_lin':>7s} | best configs (bf16 ; fp8)")
    keyed = {(r["model"], r["layer"], r["m"], r["dtype"]): r for r in rows}
    for (model, layer, m, dtype), r in keyed.items():
        if dtype != rows[0]["dtype"]:
            continue
        b, f = keyed.get((model, layer, m, "bf16")), keyed.get((model, layer, m, "fp8"))

        def col(row: dict | None, key: str, width: int) -> str:
            return f"{row[key]:{width}.2f}" if row is not None and key in row else " " * (width - 1) + "-"
        cfgs = " ; ".join(short(GemvConfig(**x["config"])) for x in (b, f) if x is not None)
        print(f"{model:13s} {layer:8s} {m:2d} | {col(b, 'gemv_bw', 9)} {col(b, 'fused_bw', 5)} "
              f"{col(b or f, 'cublas_bf16_bw', 6)} {col(b, 'triton_linear_bw', 7)} | {col(f, 'gemv_bw', 8)} "
              f"{col(f, 'fused_bw', 5)} {col(f, 'triton_linear_bw', 7)} | {cfgs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.2-3b"], choices=sorted(model_shapes))
    ap.add_argument("--layers", nargs="+", default=list(FUSION), choices=list(FUSION))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=list(WEIGHT_KINDS))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes compiling kernels ahead of the timing")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="past this many seconds from the start, shapes left get the default config only")
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    ap.add_argument("--table", type=Path, help="merge the fused forms' best configurations into this table file "
                    "(src/infer/models/kernels/gemv_tiles.json: what the engine runs)")
    args = ap.parse_args()
    for m in args.rows:
        row_bucket(m)  # 1..16, else a clear error
    if not torch.cuda.is_available():
        sys.exit("bench_gemv.py needs a CUDA GPU")
    start = time.perf_counter()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev).bytes_per_s
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    shapes = [(model, name, *layer_shapes(model)[name]) for model in args.models for name in args.layers]
    jobs = set()
    for _, name, n, k in shapes:
        for m in args.rows:
            for dtype in args.dtypes:
                for cfg in search_space(n, k, m, dtype) + [default_config(n, k, row_bucket(m), dtype)]:
                    fields = tuple(asdict(cfg).items())
                    jobs.add((row_bucket(m), dtype, fields, (), 1024))
                    jobs.add((row_bucket(m), dtype, fields, FUSION[name], k if "norm" in FUSION[name] else 1024))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        precompile(pool, jobs)
    bench = Bench(args, bw, start)
    rows: list[dict] = []
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bw, "calls_per_graph": CALLS,
              "replays": args.replays, "triton": __import__("triton").__version__, "torch": torch.__version__,
              "rows": rows}
    for model, name, n, k in shapes:
        rows.extend(bench.layer(model, name, n, k))
        args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - start
    args.out.write_text(json.dumps(result, indent=1))
    print_table(rows)
    print("\nCONFIG_TABLE entries (fastest fused form):")
    for r in rows:
        c = r["fused_config"]
        print(f"    ({r['n']}, {r['k']}, {row_bucket(r['m'])}, {r['dtype']!r}): GemvConfig({c['block_n']}, {c['block_k']}, "
              f"{c['split_k']}, {c['dot']}, {c['num_warps']}, {c['num_stages']}),")
    if args.table is not None:
        found = {(r["n"], r["k"], row_bucket(r["m"]), r["dtype"]): (f"{r['model']} {r['layer']}",
                                                                   GemvConfig(**r["fused_config"])) for r in rows}
        write_table(found, torch.cuda.get_device_name(), args.table)
        print(f"{len(found)} configurations written to {args.table}")
    print(f"\ntotal {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
