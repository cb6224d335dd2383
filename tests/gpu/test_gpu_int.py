"""Integer weights on the GPU (run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_int.py`).

- The GEMV's 4- and 8-bit paths (models/kernels/gemv.py) against the plain-torch reference
  on the dequantized matrix, bf16, at 1-16 rows, odd shapes, every fusion and the
  configurations the benchmark searches (the K-split reduction is the float GEMV's, whose
  graph replay test_triton_gemv.py checks).
- The dequantize kernel (models/kernels/dequant.py) is `dequantize_int` bit for bit, and a
  call of more than MAX_ROWS rows (prefill) is F.linear on that matrix.
- Through the engine with CUDA graphs and the fused kernels: the demo target quantized at
  load gives the greedy tokens of a dense model holding exactly its dequantized weights (up
  to near-ties: the GEMV sums in another order than cuBLAS), in plain decode and with an
  int4 draft; a GGUF file's kept codes give its dequantized model's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.near_ties import check_same_up_to_near_ties
from infer import LLM, SamplingParams
from infer.models.kernels.gemv_tiles import GemvConfig
from infer.models.layers.int_quant import IntLayout, IntScales, dequantize_int, quantize_rtn

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "for i in range(10):"]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
FLAGS = [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
         (False, True, True), (True, False, True)]


def _inputs(m: int, n: int, k: int, layout: IntLayout, norm: bool, swiglu: bool, residual: bool, seed: int
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 2 * k if swiglu else k, device="cuda", generator=g).bfloat16()
    packed, scales, offsets = quantize_rtn(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5, layout,
                                           torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16() if norm else None
    res = torch.randn(m, n, device="cuda", generator=g).bfloat16() if residual else None
    return x, packed, scales, offsets, nw, res


def _reference(x: torch.Tensor, dense: torch.Tensor, nw: torch.Tensor | None, swiglu: bool,
               res: torch.Tensor | None) -> torch.Tensor:
    from infer.models.layers.mlp import silu_mul
    from infer.models.layers.norms import rmsnorm
    a = silu_mul(x) if swiglu else x
    a = rmsnorm(a, nw, 1e-5) if nw is not None else a
    y = (a.float() @ dense.float().t()).to(x.dtype)
    return y if res is None else res + y


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all()
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _poison_allocator() -> None:
    junk = torch.full((1 << 24,), float("nan"), device="cuda")
    del junk


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_int_gemv_rows_and_shapes(m: int, bits: int) -> None:
    from infer.models.kernels.gemv import gemv
    for n, k, group in ((3072, 2048, 128), (1000, 1536, 64), (200, 1000, 8)):
        layout = IntLayout(bits, group)
        x, packed, scales, offsets, _, _ = _inputs(m, n, k, layout, False, False, False, seed=m + n)
        _poison_allocator()
        y = gemv(x, packed, IntScales(scales, offsets, layout))
        dense = dequantize_int(packed, scales, offsets, layout, torch.float32)
        assert _rel(y, _reference(x, dense, None, False, None)) < 5e-3, (n, k, group)


@pytest.mark.parametrize("norm,swiglu,residual", FLAGS)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_int_gemv_fusions(norm: bool, swiglu: bool, residual: bool, m: int, bits: int) -> None:
    from infer.models.kernels.gemv import gemv
    layout = IntLayout(bits, 128)
    x, packed, scales, offsets, nw, res = _inputs(m, 1024, 2048, layout, norm, swiglu, residual, seed=m)
    _poison_allocator()
    y = gemv(x, packed, IntScales(scales, offsets, layout), norm_weight=nw, swiglu_input=swiglu, residual=res)
    dense = dequantize_int(packed, scales, offsets, layout, torch.float32)
    assert _rel(y, _reference(x, dense, nw, swiglu, res)) < 5e-3


CONFIGS = [GemvConfig(block_n=64, block_k=128, split_k=8, num_stages=3), GemvConfig(block_n=128, block_k=64, num_stages=3),
           GemvConfig(block_n=128, block_k=128, dot=True, num_stages=3),
           GemvConfig(block_n=64, block_k=256, split_k=8, dot=True)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_int_gemv_configs(cfg: GemvConfig, bits: int) -> None:
    from infer.models.kernels.gemv import gemv
    layout = IntLayout(bits, 128)
    m = 16 if cfg.dot else 2
    x, packed, scales, offsets, nw, res = _inputs(m, 768, 4096, layout, True, False, True, seed=3)
    _poison_allocator()
    y = gemv(x, packed, IntScales(scales, offsets, layout), norm_weight=nw, residual=res, config=cfg)
    dense = dequantize_int(packed, scales, offsets, layout, torch.float32)
    assert _rel(y, _reference(x, dense, nw, False, res)) < 5e-3


@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_dequantize_and_the_wide_path(bits: int) -> None:
    from infer.models.kernels.dequant import dequantize_on_device
    from infer.models.layers.linear import IntWeights, LinearBase
    layout = IntLayout(bits, 64)
    layer = LinearBase(1536, 1000, IntWeights(layout)).cuda().bfloat16()
    layer.load_rows(torch.randn(1000, 1536, device="cuda") * 0.03, None)
    dense = dequantize_on_device(layer.qweight, IntScales(layer.scales, layer.offsets, layout))
    assert torch.equal(dense, dequantize_int(layer.qweight, layer.scales, layer.offsets, layout, torch.bfloat16))
    x = torch.randn(40, 1536, device="cuda", dtype=torch.bfloat16)  # more rows than the GEMV serves
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense))
    few = x[:3]
    assert _rel(layer(few), _reference(few, dense.float(), None, False, None)) < 5e-3


def _tokens(llm: LLM) -> list[tuple[list[int], list[int]]]:
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in llm.generate(PROMPTS, GREEDY)]


def test_gpu_int4_engine_matches_its_dequantized_twin(tmp_path: Path) -> None:
    from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
    from infer.models.loading.checkpoint import save_checkpoint
    kw = dict(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256, use_cuda_graphs=True)
    int4 = LLM(str(DEMO_TARGET), quantization="int4", **kw)
    twin_dir = save_checkpoint(int4.engine.models.target, tmp_path / "twin", dtype=torch.float32)
    twin = LLM(str(twin_dir), tokenizer=str(DEMO_TARGET), **kw)
    want = _tokens(twin)
    check_same_up_to_near_ties(twin.engine.runner.model, PROMPTS, _tokens(int4), want)
    assert int4.engine.runner.kernels.name == "fused"
    del int4
    chain = LLM(str(DEMO_TARGET), quantization="int4", use_speculative_decoding=True, spec_batch_gate=False,
                draft_model=str(DEMO_DRAFT), draft_quantization="int4", spec_length=4, **kw)
    check_same_up_to_near_ties(twin.engine.runner.model, PROMPTS, _tokens(chain), want)
    assert chain.engine.leak_report() == []


def _bf16_exact(model: torch.nn.Module) -> None:
    """Every integer layer's scales made powers of two and its offsets whole multiples of them,
    in place (the captured graphs read the same tensors): s * q + o is then exactly a bf16
    value, so the bf16 twin holds exactly the weights the GEMV computes with in float32 and
    the two runs differ by summation order alone."""
    with torch.no_grad():
        for module in model.modules():
            scales, offsets = getattr(module, "scales", None), getattr(module, "offsets", None)
            if isinstance(scales, torch.Tensor) and isinstance(offsets, torch.Tensor):
                step = torch.exp2(torch.round(torch.log2(scales.float().abs().clamp(min=2.0 ** -100))))
                steps = torch.round(offsets.float() / step)
                assert steps.abs().max() <= 240  # s * (q + steps) keeps 8 significant bits
                scales.copy_(step)
                offsets.copy_(steps * step)


def test_gpu_gguf_kept_codes_match_their_dequantized_twin(tmp_path: Path) -> None:
    # GGUF blocks kept as 4-bit codes in groups of 32 (Q4_0, Q4_1) and 8-bit (Q8_0), through
    # the GEMV under graphs, against a dense checkpoint of exactly their values (made
    # bf16-exact first; a random model's logits are nearly flat: tokens are compared up to
    # near-ties)
    from gguf import GGMLQuantizationType as Q

    from helpers.checkpoints import make_checkpoint
    from helpers.gguf_files import write_gguf
    from infer.models.loading.checkpoint import save_checkpoint
    ckpt = make_checkpoint(tmp_path / "ckpt", variant="b", hidden_size=256, intermediate_size=256)
    path = write_gguf(ckpt, tmp_path / "mix.gguf", Q.Q4_0, overrides={"attn_v": Q.Q8_0, "ffn_down": Q.Q4_1})
    kw = dict(device="cuda", dtype="bfloat16", max_batch_size=4, max_seq_len=256, use_cuda_graphs=True)
    kept = LLM(str(path), **kw)
    assert kept.engine.runner.kernels.name == "fused"
    _bf16_exact(kept.engine.models.target)
    twin = LLM(str(save_checkpoint(kept.engine.models.target, tmp_path / "twin", dtype=torch.float32)),
               tokenizer=str(ckpt), **kw)
    prompts = [[5, 77, 123, 9], [300, 41, 2, 250, 18, 64]]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got, want = ([(p, o.outputs[0].token_ids) for p, o in zip(prompts, llm.generate(
        prompt_token_ids=prompts, sampling_params=greedy), strict=True)] for llm in (kept, twin))
    check_same_up_to_near_ties(twin.engine.runner.model, [str(p) for p in prompts], got, want)
