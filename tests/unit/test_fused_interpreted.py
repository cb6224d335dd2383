"""The fused decode kernels under Triton's interpreter on the CPU (tiny shapes; skipped
without triton): the rotary + KV-cache write (models/kernels/rotary_write.py) against the eager
rotary and indexed copies, bit for bit; and the fused bundle's GEMV route
(models/kernels/bundle.py: RMSNorm prologue before qkv / gate_up, SwiGLU prologue and residual
epilogue around down, the whole MLP) against EAGER's composition, to rounding; and a tiny
EAGLE-3 head's forward and logits through that route (its MLP, its final norm + lm_head)
against the head under EAGER, to rounding.

The interpreter must be switched on before triton.language is first imported, so the
kernels run in a subprocess (`run_interpreted_cases`) and the comparisons here. fp16 and
float32 activations: the interpreter truncates float32 -> bf16 conversions instead of
rounding them (tests/gpu covers bf16).
"""

from __future__ import annotations


import pytest
import torch

from helpers.interpreted import interpreted_outputs
from infer.models.config import ModelConfig
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER, fused_kernels
from infer.models.kernels.routes import GEMV
from infer.models.layers.attention import NoCacheView
from infer.models.layers.linear import LinearBase, make_linear
from infer.models.layers.rotary import cos_sin, rotary_qk

SENTINEL = 7.0  # what cache rows no token writes keep
# (dtype, head_dim, kv heads, strided rows): a power-of-two head, one the kernel pads
# (24 -> 32), and rows given as one column of a wider table (a draft loop's step)
ROTARY_CASES = [(torch.float16, 16, 2, False), (torch.float32, 24, 1, False), (torch.float16, 16, 2, True)]
HQ, SCRATCH = 4, 39  # query heads; the pool's scratch row (the last of 40)


def _rotary_case(ci: int) -> dict[str, torch.Tensor]:
    """q, k, v as views of one qkv output [B=2, T=3, ...]; rows of a paged pool (block 4):
    row 0 holds 3 tokens at positions 5-7 (blocks 1 and 3), row 1 one token at 13 then two
    padding tokens (to the scratch row). Strided rows: column 0 of a [6, 2] table whose
    column 1 names rows no token should write."""
    dtype, d, hkv, strided = ROTARY_CASES[ci]
    g = torch.Generator().manual_seed(ci)
    qkv = torch.randn(2, 3, (HQ + 2 * hkv) * d, generator=g).to(dtype)  # [B, T, (Hq + 2 Hkv) D]
    q, k, v = qkv.split([HQ * d, hkv * d, hkv * d], dim=-1)
    positions = torch.tensor([[5, 6, 7], [13, 14, 15]])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = cos_sin(positions, inv_freq, dtype)
    rows = torch.tensor([5, 6, 7 + 8, 21, SCRATCH, SCRATCH])
    if strided:
        rows = torch.stack([rows, torch.tensor([0, 1, 2, 3, 4, 8])], dim=1)[:, 0]  # stride 2
    return {"q": q.view(2, 3, HQ, d), "k": k.view(2, 3, hkv, d), "v": v.view(2, 3, hkv, d), "cos": cos, "sin": sin,
            "rows": rows,
            "cache": torch.full((SCRATCH + 1, hkv, d), SENTINEL, dtype=dtype)}


def _layers(fp8: bool) -> tuple[LinearBase, LinearBase, LinearBase]:
    """qkv [48 x 32], gate_up [2 x 40 x 32], down [32 x 40]: fp16, or FP8 weights."""
    torch.manual_seed(1 + fp8)
    layers = []
    for k, n in ((32, 48), (32, 80), (40, 32)):
        layer = make_linear(k, n, "fp8" if fp8 else None)
        layer.load_rows(torch.randn(n, k) * k ** -0.5, None)
        layers.append(layer.half() if not fp8 else layer)
    return layers[0], layers[1], layers[2]


def _mlp_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 32, generator=g).half() * 2, (1 + 0.1 * torch.randn(32, generator=g)).half()


def _head() -> EagleHead:
    """A tiny fp16 EAGLE-3 head (hidden 32, 2 query heads and 1 KV head of 16, MLP 40, a draft
    vocabulary of 48 of the target's 64 ids) with unit-gain random matrices."""
    import dataclasses

    from infer.models.llama import LlamaForCausalLM
    from infer.models.loading.dummy_heads import dummy_eagle_head, head_config_for
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    target = LlamaForCausalLM(config).half()  # (the head reads its embedding only)
    head = dummy_eagle_head(dataclasses.replace(head_config_for(config, "eagle3"), draft_vocab_size=48), target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    return head


def _head_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions [rows, 1]; features [rows, 1, 32] fp16."""
    g = torch.Generator().manual_seed(10 + rows)
    return (torch.randint(0, 64, (rows, 1), generator=g), torch.randint(0, 50, (rows, 1), generator=g),
            torch.randn(rows, 1, 32, generator=g).half())


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    """Every kernel output the tests compare (run with TRITON_INTERPRET=1)."""
    import infer.models.kernels.bundle as bundle_module
    from infer.models.kernels.rotary_write import rotary_kv_write
    out = {}
    for ci in range(len(ROTARY_CASES)):
        c = _rotary_case(ci)
        kc, vc = c["cache"].clone(), c["cache"].clone()
        out[f"rotary-{ci}-q"] = rotary_kv_write(c["q"], c["k"], c["v"], c["cos"], c["sin"], kc, vc, c["rows"])
        out[f"rotary-{ci}-k"], out[f"rotary-{ci}-v"] = kc, vc
    # the GEMV route for every call (the route itself is chosen only on CUDA)
    bundle_module.route = lambda layer, x, part="linear": GEMV
    bundle = fused_kernels(lambda fn: fn)
    with torch.no_grad():
        for fp8 in (False, True):
            qkv, gate_up, down = _layers(fp8)
            for rows in (1, 3):
                x, nw = _mlp_inputs(rows)
                key = f"{int(fp8)}-{rows}"
                out[f"qkv-{key}"] = bundle.norm_linear(qkv, x, nw, 1e-5)
                h = EAGER.norm_linear(gate_up, x, nw, 1e-5)
                out[f"down-{key}"] = bundle.swiglu_linear(down, h, x)
                out[f"mlp-{key}"] = bundle.mlp(gate_up, down, x, nw, 1e-5)
        head = _head()
        for rows in (1, 3):
            ids, positions, features = _head_inputs(rows)
            x = head(ids, features, positions, NoCacheView(), bundle)  # [rows, 1, 32]
            out[f"head-x-{rows}"], out[f"head-logits-{rows}"] = x, head.logits(x[:, 0], bundle)
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, torch.Tensor]:
    return interpreted_outputs("test_fused_interpreted")


@pytest.mark.parametrize("ci", range(len(ROTARY_CASES)))
def test_rotary_kv_write_is_the_eager_rotary_and_copy(interpreted: dict[str, torch.Tensor], ci: int) -> None:
    c = _rotary_case(ci)
    q, k = rotary_qk(c["q"], c["k"], c["cos"], c["sin"])
    assert torch.equal(interpreted[f"rotary-{ci}-q"], q)
    kc, vc = interpreted[f"rotary-{ci}-k"], interpreted[f"rotary-{ci}-v"]
    rows = c["rows"]
    real = rows != SCRATCH
    assert torch.equal(kc[rows[real]], k.reshape(6, *k.shape[2:])[real])
    assert torch.equal(vc[rows[real]], c["v"].reshape(6, *k.shape[2:])[real])
    untouched = torch.ones(SCRATCH + 1, dtype=torch.bool)
    untouched[rows] = False
    assert (kc[untouched] == SENTINEL).all() and (vc[untouched] == SENTINEL).all()
    # the padding tokens wrote the scratch row (one of them: their order is unspecified)
    assert any(torch.equal(kc[SCRATCH], k.reshape(6, *k.shape[2:])[i]) for i in (4, 5))


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert y.shape == ref.shape and y.dtype == ref.dtype and torch.isfinite(y).all()
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_route_matches_eager_composition(interpreted: dict[str, torch.Tensor], fp8: bool, rows: int) -> None:
    qkv, gate_up, down = _layers(fp8)
    x, nw = _mlp_inputs(rows)
    key = f"{int(fp8)}-{rows}"
    with torch.no_grad():
        h = EAGER.norm_linear(gate_up, x, nw, 1e-5)
        want = {"qkv": EAGER.norm_linear(qkv, x, nw, 1e-5), "down": EAGER.swiglu_linear(down, h, x),
                "mlp": EAGER.mlp(gate_up, down, x, nw, 1e-5)}
    for name, ref in want.items():
        # the same math; the GEMV sums in float32 in its own order
        assert _rel_err(interpreted[f"{name}-{key}"], ref) < 3e-3, name


@pytest.mark.parametrize("rows", [1, 3])
def test_eagle_head_through_the_gemv_route_matches_eager(interpreted: dict[str, torch.Tensor], rows: int) -> None:
    """The head's projections, MLP (RMSNorm and SwiGLU prologues, residual epilogues) and
    final norm + lm_head through the GEMV give the head's EAGER outputs and logits."""
    head = _head()
    ids, positions, features = _head_inputs(rows)
    with torch.no_grad():
        x = head(ids, features, positions, NoCacheView())
        logits = head.logits(x[:, 0])  # [rows, 64]: -inf off the draft vocabulary
    assert _rel_err(interpreted[f"head-x-{rows}"], x) < 3e-3
    got = interpreted[f"head-logits-{rows}"]
    drafted = torch.isfinite(logits)
    assert torch.equal(torch.isfinite(got), drafted) and int(drafted[0].sum()) == 48
    assert _rel_err(got[drafted], logits[drafted]) < 3e-3
