"""The fused decode kernels on the GPU (run on the GPU machine: `pytest -m gpu tests/gpu`).

- The rotary + KV-cache write kernel (models/kernels/rotary_write.py) is bit-identical to the eager
  rotary and indexed copies in bf16, fp16 and float32.
- The fused bundle's entries (models/kernels/routes.py: the GEMV with its prologues at
  one row, cuBLAS or the Triton matmul at more) match EAGER's composition to bf16 rounding,
  dense and FP8, for the row counts of decode, a chain verification and a batch.
- Greedy tokens of the demo target, bf16 and FP8, CUDA graphs on: the fused bundle gives
  EAGER's tokens in plain decode and under chain speculation (verification of K + 1 rows
  through the multi-row routes). The GEMV sums in another order than cuBLAS, so a token
  may differ where EAGER's own logits see a near-tie; anywhere else it is a bug.
"""

from __future__ import annotations

import pytest
import torch

from helpers.near_ties import check_same_up_to_near_ties
from infer import LLM, SamplingParams
from infer.models.kernels.bundle import EAGER, Kernels, compiled_kernels
from infer.models.layers.rotary import cos_sin, rotary_qk

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "for i in range(10):"]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_kv_write_is_bit_identical_to_eager(dtype: torch.dtype) -> None:
    from infer.models.kernels.rotary_write import rotary_kv_write
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, t, hq, hkv, d = 3, 6, 24, 8, 128
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda", generator=gen).to(dtype) * 4
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
    positions = torch.randint(0, 100_000, (b, t), device="cuda", generator=gen)  # long contexts too
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    cos, sin = cos_sin(positions, inv_freq, dtype)
    rows = torch.randperm(200, device="cuda", generator=gen)[:b * t]
    rows[-2:] = 200  # two padding tokens to the scratch row
    kc = torch.zeros(201, hkv, d, device="cuda", dtype=dtype)
    vc = torch.zeros_like(kc)
    got_q = rotary_kv_write(q, k, v, cos, sin, kc, vc, rows)
    want_q, want_k = rotary_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q)
    real = rows[:-2]
    assert torch.equal(kc[real], want_k.reshape(-1, hkv, d)[:-2])
    assert torch.equal(vc[real], v.reshape(-1, hkv, d)[:-2])


@pytest.fixture(scope="module")
def fused() -> Kernels:
    """One compiled bundle for the module's cases (its token dimensions become dynamic)."""
    return compiled_kernels()


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("rows", [1, 2, 6, 16, 24])
def test_fused_entries_match_eager_composition(fused: Kernels, quantization: str | None, rows: int) -> None:
    from infer.models.layers.linear import make_linear
    torch.manual_seed(rows)
    hidden, inter, qkv_n = 1024, 2816, 1536
    qkv = make_linear(hidden, qkv_n, quantization).cuda().bfloat16()
    gate_up = make_linear(hidden, 2 * inter, quantization).cuda().bfloat16()
    down = make_linear(inter, hidden, quantization).cuda().bfloat16()
    for layer in (qkv, gate_up, down):
        layer.load_rows(torch.randn(layer.out_features, layer.in_features, device="cuda") * 0.03, None)
    x = torch.randn(rows, 1, hidden, device="cuda", dtype=torch.bfloat16)  # [B, T, H]
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    with torch.no_grad():
        h = EAGER.norm_linear(gate_up, x, nw, 1e-5)
        pairs = [(fused.norm_linear(qkv, x, nw, 1e-5), EAGER.norm_linear(qkv, x, nw, 1e-5)),
                 (fused.swiglu_linear(down, h, x), EAGER.swiglu_linear(down, h, x)),
                 (fused.mlp(gate_up, down, x, nw, 1e-5), EAGER.mlp(gate_up, down, x, nw, 1e-5))]
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def _tokens(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) per prompt."""
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in llm.generate(PROMPTS, GREEDY)]


def _check_same_up_to_near_ties(eager: LLM, got: list[tuple[list[int], list[int]]],
                                want: list[tuple[list[int], list[int]]]) -> None:
    """got == want up to near-ties EAGER's own logits see (helpers/near_ties.py)."""
    check_same_up_to_near_ties(eager.engine.runner.model, PROMPTS, got, want)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fused_greedy_tokens_match_eager_plain_and_chain(quantization: str | None) -> None:
    from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
    kw = dict(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256, use_cuda_graphs=True,
              quantization=quantization)
    eager = LLM(str(DEMO_TARGET), compile_kernels=False, **kw)
    want = _tokens(eager)
    fused = LLM(str(DEMO_TARGET), compile_kernels=True, **kw)
    assert fused.engine.runner.kernels.name == "fused" and eager.engine.runner.kernels is EAGER
    _check_same_up_to_near_ties(eager, _tokens(fused), want)
    del fused
    chain = LLM(str(DEMO_TARGET), compile_kernels=True, use_speculative_decoding=True, spec_batch_gate=False,
                draft_model=str(DEMO_DRAFT), spec_length=4, draft_quantization=quantization, **kw)
    _check_same_up_to_near_ties(eager, _tokens(chain), want)
    assert chain.engine.runner.forward_fn.replays > 0  # the chain's K + 1 rows ran through the graphs
    for llm in (eager, chain):
        assert llm.engine.leak_report() == []
