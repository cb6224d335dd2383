"""The integer-weight kernels under Triton's interpreter on the CPU (tiny shapes; skipped
without triton): the GEMV's 4- and 8-bit paths (FMA and dot tiles, K splits, the RMSNorm
and SwiGLU prologues and the residual epilogue) against the plain-torch reference on the
dequantized matrix; the dequantize kernel bit for bit against `dequantize_int`; and the
fused bundle's GEMV route over integer layers against EAGER's composition.

fp16 activations, as the other interpreted tests (the interpreter rounds float32 -> bf16
wrongly); tests/gpu/test_gpu_int.py covers bf16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.interpreted import interpreted_outputs
from infer.models.kernels.bundle import EAGER
from infer.models.kernels.gemv_tiles import GemvConfig
from infer.models.kernels.matmul_tiles import SplitWorkspace
from infer.models.kernels.routes import GEMV
from infer.models.layers.int_quant import IntLayout, IntScales, dequantize_int, quantize_rtn
from infer.models.layers.linear import IntWeights, LinearBase
from test_triton_gemv import FLAGS, gemv_reference, rel_err

# (config, layout, flags indices, K): 4-bit FMA / dot / split; 8-bit FMA and dot with a split;
# the scales read one a row (a tile in one group), as a tile of groups, or column by column
# (groups of 48 across tiles of 32 columns)
CASES = [(GemvConfig(block_n=4, block_k=32), IntLayout(4, 32), range(len(FLAGS)), 64),
         (GemvConfig(block_n=16, block_k=32, dot=True), IntLayout(4, 16), (0, 1, 4), 64),
         (GemvConfig(block_n=8, block_k=32, split_k=2), IntLayout(4, 32), (0, 3, 5), 64),
         (GemvConfig(block_n=4, block_k=16), IntLayout(8, 16), (0, 2, 5), 64),
         (GemvConfig(block_n=16, block_k=32, split_k=2, dot=True), IntLayout(8, 32), (0, 1, 4), 64),
         (GemvConfig(block_n=4, block_k=32), IntLayout(4, 48), (0, 5), 96),
         (GemvConfig(block_n=8, block_k=32, split_k=2), IntLayout(8, 8), (0, 2), 64)]
N = 40


def _case(ci: int, fi: int) -> tuple[torch.Tensor, ...]:
    """x, packed codes, scales, offsets, norm weight, residual (fp16) of one case."""
    norm, swiglu, residual = FLAGS[fi]
    k = CASES[ci][3]
    g = torch.Generator().manual_seed(100 * ci + fi)
    m = (1, 3)[fi % 2]
    x = torch.randn(m, 2 * k if swiglu else k, generator=g).half()
    packed, scales, offsets = quantize_rtn(torch.randn(N, k, generator=g) * k ** -0.5, CASES[ci][1], torch.float16)
    nw = (1.0 + 0.1 * torch.randn(k, generator=g)).half() if norm else None
    res = torch.randn(m, N, generator=g).half() if residual else None
    return x, packed, scales, offsets, nw, res


def _layers(bits: int) -> tuple[LinearBase, LinearBase, LinearBase]:
    """qkv [48 x 32], gate_up [80 x 32], down [32 x 40] as fp16 integer layers (groups of 16, 8)."""
    torch.manual_seed(7 + bits)
    layers = []
    for k, n in ((32, 48), (32, 80), (40, 32)):
        layer = LinearBase(k, n, IntWeights(IntLayout(bits, 16 if k == 32 else 8))).half()
        layer.load_rows(torch.randn(n, k) * k ** -0.5, None)
        layers.append(layer)
    return layers[0], layers[1], layers[2]


def _mlp_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 32, generator=g).half() * 2, (1 + 0.1 * torch.randn(32, generator=g)).half()


def _extreme_case() -> tuple[torch.Tensor, ...]:
    """One row of x from 1e-6 to 6e4 in magnitude (fp16's range) against 4-bit codes whose group
    scales span 1e-6 to 1e-3: the one-row kernel's scaled products must stay exact and finite."""
    g = torch.Generator().manual_seed(5)
    k = 64
    x = (torch.randn(1, k, generator=g) * 10.0 ** torch.linspace(-6, 4.7, k)).clamp(-6e4, 6e4).half()
    dense = torch.randn(N, k, generator=g) * 10.0 ** torch.linspace(-6, -3, N)[:, None]
    packed, scales, offsets = quantize_rtn(dense, IntLayout(4, 32), torch.float16)
    return x, packed, scales, offsets


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    """Every kernel output the tests compare (run with TRITON_INTERPRET=1)."""
    import infer.models.kernels.bundle as bundle_module
    from infer.models.kernels.bundle import fused_kernels
    from infer.models.kernels.dequant import dequantize_on_device
    from infer.models.kernels.gemv import gemv
    out = {}
    for ci, (cfg, layout, flags, _) in enumerate(CASES):
        for fi in flags:
            x, packed, scales, offsets, nw, res = _case(ci, fi)
            out[f"gemv-{ci}-{fi}"] = gemv(x, packed, IntScales(scales, offsets, layout), norm_weight=nw,
                                          swiglu_input=FLAGS[fi][1], residual=res, config=cfg)
        _, packed, scales, offsets, _, _ = _case(ci, 0)
        out[f"dequant-{ci}"] = dequantize_on_device(packed, IntScales(scales, offsets, layout))
    x, packed, scales, offsets = _extreme_case()
    out["gemv-extreme"] = gemv(x, packed, IntScales(scales, offsets, IntLayout(4, 32)),
                               config=GemvConfig(block_n=4, block_k=32))
    workspace, split = SplitWorkspace(), GemvConfig(block_n=8, block_k=16, split_k=4)
    for call in range(2):  # the layer's counters, reused: the last program of each row block resets its own
        out[f"split-{call}"] = gemv(x, packed, IntScales(scales, offsets, IntLayout(4, 32)), config=split,
                                    workspace=workspace)
    out["split-counters"] = workspace.gemv_counters
    bundle_module.route = lambda layer, x, part="linear": GEMV  # (chosen only on CUDA)
    bundle = fused_kernels(lambda fn: fn)
    with torch.no_grad():
        for bits in (4, 8):
            qkv, gate_up, down = _layers(bits)
            for rows in (1, 3):
                x, nw = _mlp_inputs(rows)
                out[f"qkv-{bits}-{rows}"] = bundle.norm_linear(qkv, x, nw, 1e-5)
                out[f"mlp-{bits}-{rows}"] = bundle.mlp(gate_up, down, x, nw, 1e-5)
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, torch.Tensor]:
    return interpreted_outputs("test_int_interpreted")


@pytest.mark.parametrize("ci", range(len(CASES)))
def test_int_gemv_matches_the_dequantized_reference(interpreted: dict[str, torch.Tensor], ci: int) -> None:
    layout = CASES[ci][1]
    for fi in CASES[ci][2]:
        x, packed, scales, offsets, nw, res = _case(ci, fi)
        dense = dequantize_int(packed, scales, offsets, layout, torch.float32)  # [N, K]
        ref = gemv_reference(x, dense, norm_weight=nw, swiglu_input=FLAGS[fi][1], residual=res)
        y = interpreted[f"gemv-{ci}-{fi}"]
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) < 5e-3, (CASES[ci][0], layout, FLAGS[fi])


@pytest.mark.parametrize("ci", range(len(CASES)))
def test_dequantize_kernel_is_dequantize_int(interpreted: dict[str, torch.Tensor], ci: int) -> None:
    _, packed, scales, offsets, _, _ = _case(ci, 0)
    want = dequantize_int(packed, scales, offsets, CASES[ci][1], torch.float16)
    assert torch.equal(interpreted[f"dequant-{ci}"], want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_route_over_integer_layers_matches_eager(interpreted: dict[str, torch.Tensor], bits: int,
                                                      rows: int) -> None:
    qkv, gate_up, down = _layers(bits)
    x, nw = _mlp_inputs(rows)
    with torch.no_grad():
        want = {"qkv": EAGER.norm_linear(qkv, x, nw, 1e-5), "mlp": EAGER.mlp(gate_up, down, x, nw, 1e-5)}
    for name, ref in want.items():
        got = interpreted[f"{name}-{bits}-{rows}"]
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_err(got, ref) < 3e-3, name


def test_one_row_int4_gemv_keeps_extreme_magnitudes(interpreted: dict[str, torch.Tensor]) -> None:
    x, packed, scales, offsets = _extreme_case()
    dense = dequantize_int(packed, scales, offsets, IntLayout(4, 32), torch.float32)  # [N, K]
    ref = x.float() @ dense.t()  # [1, N]
    y = interpreted["gemv-extreme"].float()
    assert torch.isfinite(y).all()
    # each output within fp16 rounding of the float32 sums, row by row (rows differ by 1e6 in size)
    assert ((y - ref).abs() <= 2e-3 * ref.abs() + 1e-3 * (x.float().abs() @ dense.abs().t())).all()


def test_split_calls_share_a_workspace_and_leave_its_counters_zero(interpreted: dict[str, torch.Tensor]) -> None:
    x, packed, scales, offsets = _extreme_case()
    dense = dequantize_int(packed, scales, offsets, IntLayout(4, 32), torch.float32)  # [N, K]
    ref = x.float() @ dense.t()  # [1, N]
    counters = interpreted["split-counters"]
    assert counters.numel() >= N and not counters.any()
    assert torch.equal(interpreted["split-0"], interpreted["split-1"])
    y = interpreted["split-0"].float()
    assert ((y - ref).abs() <= 2e-3 * ref.abs() + 1e-3 * (x.float().abs() @ dense.abs().t())).all()
