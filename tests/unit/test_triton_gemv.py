"""The few-row matmul (models/kernels/gemv.py) and its launch parameters (models/kernels/gemv_tiles.py).

`gemv_reference` is the fused computation in plain torch (float32 inside, rounded where
PyTorch's unfused layers round); on the CPU it is checked against that unfused composition
(`kernels.rmsnorm`, `kernels.silu_mul`, `F.linear`, the residual add), and the kernel is
checked against it: under Triton's interpreter on the CPU (tiny shapes; skipped without
triton) and compiled on a GPU (marked `gpu`).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from helpers.interpreted import interpreted_outputs
from bench_gemv import candidate_configs, with_splits, write_table  # the table's search (scripts/)
from infer.models.kernels.gemv_tiles import (CONFIG_TABLE, MAX_ROWS, NUM_SMS, TABLE_FILE, WEIGHT_KINDS, GemvConfig,
                                             check_inputs, config_for, default_config, int_default, int_tile,
                                             read_table, row_bucket)
from infer.models.layers.fp8 import dequantize_fp8, quantize_fp8_rows
from infer.models.layers.int_quant import IntLayout, IntScales
from infer.models.layers.mlp import silu_mul
from infer.models.layers.norms import rmsnorm

FP8 = torch.float8_e4m3fn


def gemv_input_reference(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                         swiglu_input: bool) -> torch.Tensor:
    """The matmul's input after the fused prologue: x [M, K] (or [M, 2K] gate | up) -> [M, K]."""
    dt = x.dtype
    if swiglu_input:
        gate, up = x.float().chunk(2, dim=-1)
        x = ((gate / (1.0 + torch.exp(-gate))).to(dt).float() * up).to(dt)
    if norm_weight is not None:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) / xf.shape[-1] + eps)).to(dt)
        x = (normed.float() * norm_weight.float()).to(dt)
    return x


def gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-5, swiglu_input: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """What `gemv` computes, in plain torch: [M, N] in x's dtype."""
    a = gemv_input_reference(x, norm_weight, eps, swiglu_input).float()  # [M, K]
    y = a @ w.float().t()  # [M, N], float32 sums
    if scale is not None:
        y = y * scale.float()
    y = y.to(x.dtype)
    return y if residual is None else (y.float() + residual.float()).to(x.dtype)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (an element left unwritten?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, fp8: bool, device: str, norm: bool, swiglu: bool,
                residual: bool, seed: int) -> tuple[torch.Tensor, ...]:
    """Random x (gate | up when swiglu), w (quantized when fp8), scale, norm weight, residual."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if swiglu else k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    scale = None
    if fp8:
        w, scale = quantize_fp8_rows(w)
    else:
        w = w.to(dtype)
    nw = (1.0 + 0.1 * torch.randn(k, generator=g)).to(dtype) if norm else None
    res = torch.randn(m, n, generator=g).to(dtype) if residual else None
    return tuple(t.to(device) if t is not None else None for t in (x, w, scale, nw, res))


FLAGS = [  # (norm, swiglu, residual): the fusions of a decoder layer's matmuls
    (False, False, False), (True, False, False), (False, True, False), (False, False, True),
    (False, True, True), (True, False, True)]


# ---- the reference against the unfused layers (CPU) ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_prologues_are_the_layers(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 96).to(dtype) * 3
    nw = (1 + 0.1 * torch.randn(96)).to(dtype)
    torch.testing.assert_close(gemv_input_reference(x, nw, 1e-5, False), rmsnorm(x, nw, 1e-5), rtol=0, atol=0)
    torch.testing.assert_close(gemv_input_reference(x, None, 0.0, True), silu_mul(x), rtol=1e-2, atol=1e-6)
    assert torch.equal(gemv_input_reference(x, None, 0.0, False), x)


@pytest.mark.parametrize("norm,swiglu,residual", FLAGS)
@pytest.mark.parametrize("fp8", [False, True])
def test_reference_matches_unfused_composition(norm: bool, swiglu: bool, residual: bool, fp8: bool) -> None:
    x, w, scale, nw, res = make_inputs(7, 48, 128, torch.bfloat16, fp8, "cpu", norm, swiglu, residual, seed=1)
    a = silu_mul(x) if swiglu else x
    a = rmsnorm(a, nw, 1e-5) if norm else a
    dense = dequantize_fp8(w, scale, torch.float32) if fp8 else w.float()
    unfused = F.linear(a.float(), dense).to(x.dtype)
    unfused = unfused if res is None else res + unfused
    fused = gemv_reference(x, w, scale, norm_weight=nw, swiglu_input=swiglu, residual=res)
    assert fused.dtype == x.dtype and fused.shape == (7, 48)
    # identical math up to the float32 summation order: at most a rounding step apart
    assert (fused.float() - unfused.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * (
        unfused.float().abs().max())
    # the eager layers' bf16 matmul gives the same up to its own rounding
    eager = F.linear(a, dense.to(x.dtype))
    eager = eager if res is None else res + eager
    assert rel_err(fused, eager) < 1e-2


# ---- launch parameters (pure Python) ----

def test_config_validation() -> None:
    for bad in (dict(block_n=12), dict(block_k=8), dict(split_k=3), dict(dot=True, block_n=8), dict(num_warps=3),
                dict(num_stages=0)):
        with pytest.raises(ValueError, match="GemvConfig"):
            GemvConfig(**bad)


def test_row_bucket() -> None:
    assert [row_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    for m in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            row_bucket(m)


def fits_registers(cfg: GemvConfig, bucket: int, kind: str = "bf16") -> bool:
    """Whether an FMA accumulator [bucket, block_n, block_k] (integer codes: one value a
    32-bit word of codes) stays within 64 float32 registers a thread (larger ones spill);
    dot tiles always do at these sizes."""
    width = cfg.block_k * int(kind[3:]) // 32 if kind in ("int4", "int8") else cfg.block_k
    return cfg.dot or bucket * cfg.block_n * width <= 64 * 32 * cfg.num_warps


@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 16])
def test_candidates_fit_registers_and_splits_fill_the_gpu(bucket: int) -> None:
    cands = candidate_configs(bucket)
    assert cands and len(set(cands)) == len(cands)
    for cfg in cands:
        assert fits_registers(cfg, bucket), cfg
        splits = with_splits(cfg, 2048, 8192)  # a narrow, deep matrix (1B down)
        assert splits[0] == cfg
        for s in splits[1:]:
            programs = -(-2048 // s.block_n) * s.split_k
            assert NUM_SMS <= programs <= 8 * NUM_SMS and 8192 // s.block_k >= 2 * s.split_k
    with pytest.raises(ValueError, match="bucket"):
        candidate_configs(3)


@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (128256, 3072), (40, 48)])
@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_default_config(n: int, k: int, bucket: int, kind: str) -> None:
    cfg = default_config(n, k, bucket, kind)
    assert fits_registers(cfg, bucket)
    if bucket <= 2:  # FMA, never split: the reduction's launch costs more than a split gains
        assert not cfg.dot and cfg.split_k == 1
        return
    assert cfg.dot
    programs = -(-n // cfg.block_n) * cfg.split_k
    k_steps = -(-k // cfg.block_k)
    assert 2 * programs >= 5 * NUM_SMS or k_steps < 4 * cfg.split_k  # enough programs, or K too short
    if cfg.split_k > 1:  # and the smallest such split
        assert 2 * (programs // 2) < 5 * NUM_SMS and k_steps >= 2 * cfg.split_k


@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (5120, 3072), (128256, 3072), (40, 48)])
@pytest.mark.parametrize("bucket", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_int_default_config_fills_the_gpu_one_group_a_step(n: int, k: int, bucket: int, kind: str) -> None:
    cfg = default_config(n, k, bucket, kind)
    assert cfg == int_default(n, k, bucket) and cfg.block_k == 128 and cfg.dot == (bucket > 2)
    assert bucket * cfg.block_n * cfg.block_k // 8 <= 64 * 32 * cfg.num_warps or cfg.dot  # words a thread
    programs, steps = -(-n // cfg.block_n) * cfg.split_k, -(-k // cfg.block_k)
    fill = (2 if cfg.dot else 3) * NUM_SMS
    assert programs >= fill or cfg.split_k == 16 or steps // (2 * cfg.split_k) < 2  # full, or no split left
    if cfg.split_k > 1:  # the smallest such split, two steps a split at least
        assert programs // 2 < fill and steps >= 4 * (cfg.split_k // 2)


@pytest.mark.parametrize("group,bits,want", [(128, 4, (128, True)), (64, 4, (64, False)), (48, 4, (16, False)),
                                             (64, 8, (64, True)), (32, 8, (32, False)), (8, 8, (8, False))])
def test_int_tile_keeps_a_step_inside_one_group(group: int, bits: int, want: tuple[int, bool]) -> None:
    assert int_tile(GemvConfig(block_n=64, block_k=128, dot=True), IntLayout(bits, group)) == want
    assert int_tile(GemvConfig(block_k=64), IntLayout(bits, group))[0] == min(64, want[0])


def test_int_inputs_need_whole_words() -> None:
    x = torch.zeros(1, 12, dtype=torch.bfloat16)
    layout = IntLayout(4, 6)
    ints = IntScales(torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.bfloat16), layout)
    with pytest.raises(ValueError, match="do not split into words"):
        check_inputs(x, torch.zeros(2, 6, dtype=torch.uint8), ints, None, False, None)


def test_table_entries_are_searched_configs() -> None:
    """Every measured entry is a candidate tile of its row bucket with one of its shape's splits."""
    assert CONFIG_TABLE
    for (n, k, bucket, kind), cfg in CONFIG_TABLE.items():
        assert kind in WEIGHT_KINDS and fits_registers(cfg, bucket, kind)
        assert any(cfg in with_splits(c, n, k) for c in candidate_configs(bucket, kind)), (n, k, bucket, kind, cfg)
        assert config_for(n, k, bucket, kind) == cfg


def test_config_for_prefers_the_table() -> None:
    key = (4096, 1024, 4, "fp8")
    assert key not in CONFIG_TABLE
    assert config_for(4096, 1024, 3, "fp8") == default_config(4096, 1024, 4, "fp8")
    chosen = GemvConfig(block_n=8, block_k=128, split_k=2)
    CONFIG_TABLE[key] = chosen
    try:
        assert config_for(4096, 1024, 3, "fp8") == chosen
        assert config_for(4096, 1024, 3, "bf16") == default_config(4096, 1024, 4, "bf16")
    finally:
        del CONFIG_TABLE[key]


def test_a_measured_table_merges_into_the_file_the_engine_reads(tmp_path) -> None:
    path = tmp_path / "tiles.json"
    path.write_text(TABLE_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    write_table({}, "NVIDIA H200", path)
    assert path.read_text(encoding="utf-8") == TABLE_FILE.read_text(encoding="utf-8")  # its own layout
    old_key, new_key = next(iter(CONFIG_TABLE)), (4096, 1024, 4, "fp8")
    replaced, added = GemvConfig(block_n=4, block_k=256), GemvConfig(block_n=8, block_k=128, split_k=2)
    write_table({old_key: ("m a", replaced), new_key: ("m b", added)}, "some GPU", path)
    table = read_table(path)
    assert table[old_key] == replaced and table[new_key] == added and len(table) == len(CONFIG_TABLE) + 1
    assert all(table[key] == cfg for key, cfg in CONFIG_TABLE.items() if key != old_key)
    assert '"device": "some GPU"' in path.read_text(encoding="utf-8")


def test_check_inputs_names_the_fix() -> None:
    x, w, scale, nw, res = make_inputs(2, 8, 32, torch.bfloat16, True, "cpu", True, False, True, seed=2)
    check_inputs(x, w, scale, nw, False, res)  # valid
    wb = torch.randn(8, 32).to(torch.bfloat16)
    cases = [
        ((x[0], w, scale, None, False, None), "x \\[M, K\\]"),
        ((torch.zeros(17, 32, dtype=torch.bfloat16), w, scale, None, False, None), "1..16 rows"),
        ((x.float(), w, scale, None, False, None), "bfloat16 or float16"),
        ((torch.zeros(32, 2, dtype=torch.bfloat16).t(), w, scale, None, False, None), "contiguous along K"),
        ((x[:, :16], w, scale, None, False, None), "must be \\[M, 32\\]"),
        ((x, w, scale, None, True, None), "gate \\| up"),
        ((x, wb.half(), None, None, False, None), "float8_e4m3fn or x's dtype"),
        ((x, w, None, None, False, None), "per-row float32 scale"),
        ((x, wb, scale, None, False, None), "only an FP8 weight"),
        ((x, w, scale.double(), None, False, None), "contiguous float32 \\[N=8\\]"),
        ((x, w, scale, nw.float(), False, None), "norm_weight"),
        ((torch.cat([x, x], 1), w, scale, nw, True, None), "not both"),
        ((x, w, scale, None, False, res[:1]), "residual must be \\[M=2, N=8\\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check_inputs(*args)


# ---- the kernel under Triton's interpreter (CPU) ----

# fp16 activations: the interpreter (triton 3.9) truncates float32 -> bf16 conversions instead
# of rounding them to nearest, and multiplies bf16 tl.dot operands wrongly; numpy's float16
# is exact. The GPU tests cover bf16.
INTERPRETED = [(GemvConfig(block_n=4, block_k=32), False), (GemvConfig(block_n=8, block_k=16, split_k=2), False),
               (GemvConfig(block_n=16, block_k=32, dot=True), False), (GemvConfig(block_n=4, block_k=32), True),
               (GemvConfig(block_n=16, block_k=32, split_k=4, dot=True), True)]


def _interpreted_case(ci: int, fi: int) -> tuple[torch.Tensor, ...]:
    norm, swiglu, residual = FLAGS[fi]
    return make_inputs((1, 3)[fi % 2], 40, 80, torch.float16, INTERPRETED[ci][1], "cpu", norm, swiglu, residual,
                       seed=10 * ci + fi)


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    """The kernel's output for every INTERPRETED config and FLAGS combination (called in a
    subprocess that has TRITON_INTERPRET=1 set before triton is imported)."""
    from infer.models.kernels.gemv import gemv
    out = {}
    for ci, (cfg, _) in enumerate(INTERPRETED):
        for fi, (_, swiglu, _) in enumerate(FLAGS):
            x, w, scale, nw, res = _interpreted_case(ci, fi)
            out[f"{ci}-{fi}"] = gemv(x, w, scale, norm_weight=nw, swiglu_input=swiglu, residual=res, config=cfg)
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, torch.Tensor]:
    """`run_interpreted_cases` under Triton's interpreter (tests/helpers/interpreted.py)."""
    return interpreted_outputs("test_triton_gemv")


@pytest.mark.parametrize("ci", range(len(INTERPRETED)))
def test_interpreted_kernel_matches_reference(interpreted: dict[str, torch.Tensor], ci: int) -> None:
    for fi, (_, swiglu, _) in enumerate(FLAGS):
        x, w, scale, nw, res = _interpreted_case(ci, fi)
        ref = gemv_reference(x, w, scale, norm_weight=nw, swiglu_input=swiglu, residual=res)
        y = interpreted[f"{ci}-{fi}"]
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) < 5e-3, (INTERPRETED[ci], FLAGS[fi])


# ---- the compiled kernel (GPU) ----

def _poison_allocator() -> None:
    """Fill freed CUDA memory with NaN so that an output element the kernel skips shows."""
    junk = torch.full((1 << 24,), float("nan"), device="cuda")
    del junk


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_rows_and_odd_shapes(m: int, fp8: bool) -> None:
    from infer.models.kernels.gemv import gemv
    for n, k in ((1000, 1536), (3072, 2048), (200, 1000)):
        x, w, scale, _, _ = make_inputs(m, n, k, torch.bfloat16, fp8, "cuda", False, False, False, seed=m * 7 + n)
        _poison_allocator()
        y = gemv(x, w, scale)
        assert rel_err(y.cpu(), gemv_reference(x.cpu(), w.cpu(), None if scale is None else scale.cpu())) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("norm,swiglu,residual", FLAGS)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_fusions_match_reference(norm: bool, swiglu: bool, residual: bool, m: int, fp8: bool) -> None:
    from infer.models.kernels.gemv import gemv
    x, w, scale, nw, res = make_inputs(m, 1024, 2048, torch.bfloat16, fp8, "cuda", norm, swiglu, residual, seed=m)
    _poison_allocator()
    y = gemv(x, w, scale, norm_weight=nw, swiglu_input=swiglu, residual=res)
    cpu = [t.cpu() if t is not None else None for t in (x, w, scale, nw, res)]
    ref = gemv_reference(cpu[0], cpu[1], cpu[2], norm_weight=cpu[3], swiglu_input=swiglu, residual=cpu[4])
    assert rel_err(y.cpu(), ref) < 5e-3


GPU_CONFIGS = [GemvConfig(block_n=8, block_k=512, split_k=4), GemvConfig(block_n=16, block_k=1024, num_warps=8),
               GemvConfig(block_n=8, block_k=512, num_stages=3), GemvConfig(block_n=32, block_k=128, dot=True, num_stages=3),
               GemvConfig(block_n=16, block_k=256, split_k=8, dot=True, num_stages=3)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS)
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_configs_match_reference(cfg: GemvConfig, fp8: bool) -> None:
    from infer.models.kernels.gemv import gemv
    m = 16 if cfg.dot else 2
    x, w, scale, nw, res = make_inputs(m, 768, 4096, torch.float16, fp8, "cuda", True, False, True, seed=3)
    _poison_allocator()
    y = gemv(x, w, scale, norm_weight=nw, residual=res, config=cfg)
    cpu = [t.cpu() if t is not None else None for t in (x, w, scale, nw, res)]
    assert rel_err(y.cpu(), gemv_reference(cpu[0], cpu[1], cpu[2], norm_weight=cpu[3], residual=cpu[4])) < 5e-3


@pytest.mark.gpu
def test_gpu_split_k_replays_in_a_graph_bit_for_bit() -> None:
    """The split-K sum has a fixed order: eager calls and graph replays agree exactly, and the
    layer's counters (one workspace for every call) are back at zero after each."""
    from infer.models.kernels.gemv import gemv
    from infer.models.kernels.matmul_tiles import SplitWorkspace
    cfg, ws = GemvConfig(block_n=16, block_k=256, split_k=8), SplitWorkspace()
    x, w, scale, _, res = make_inputs(4, 512, 8192, torch.bfloat16, True, "cuda", False, False, True, seed=4)
    eager = gemv(x, w, scale, residual=res, config=cfg, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, scale, residual=res, config=cfg, workspace=ws)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and not ws.gemv_counters.any()
    x.copy_(torch.randn_like(x))  # a fresh input through the same graph
    graph.replay()
    assert torch.equal(out, gemv(x, w, scale, residual=res, config=cfg, workspace=ws))
    del graph
