"""GPU tests of EAGLE heads (run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_eagle.py`).

A head's rounds replayed as CUDA graphs (engine/executor/head_graphs.py) give the same greedy
tokens as the eager head, EAGLE and EAGLE-3, batch 1 and a batch that pads to a bucket, and
seeded sampled rounds the same tokens as well; a static tree (eager head levels, the
target's verification as a CUDA graph in its greedy or "draft_probs" mode) the same tokens
as without graphs; nothing leaks. The head through the fused bundle: its forward and logits
match EAGER's to bf16 rounding (the GEMV route at one row), and with CUDA graphs and
compiled kernels its rounds run its own fused bundle and draft what the eager kernels draft
(float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.eagle_heads import write_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams
from infer.models.attention import NoCacheView
from infer.models.eagle import load_eagle_head
from infer.models.kernels import EAGER, compiled_kernels
from infer.models.loader import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_heads(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_heads")
    return {"eagle3": write_head(root / "eagle3", ckpt_a, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1]),
            "eagle": write_head(root / "eagle", ckpt_a, "eagle", fc_bias=True)}


def _outputs(ckpt: Path, head: Path, method: str, graphs: bool, prompts: list[list[int]],
             params: list[SamplingParams], **options) -> tuple[list[list[int]], LLM]:
    options = {"compile_kernels": False, **options}
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256,
              use_cuda_graphs=graphs, use_speculative_decoding=True, speculative_method=method,
              draft_model=str(head), spec_length=3, **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.leak_report() == []
    return outs, llm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_graphs_token_identical_to_eager(ckpt_a, gpu_heads, method, batch, temperature):
    prompts = word_prompts(ckpt_a, 6)
    params = [SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=s) for s in range(6)]
    eager, _ = _outputs(ckpt_a, gpu_heads[method], method, False, prompts[:batch], params[:batch])
    graphed, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts[:batch], params[:batch])
    assert graphed == eager
    proposer = llm.engine.runner.speculation.proposer
    assert proposer.round_fn.replays > 0  # the rounds ran as graphs
    assert {(b, w, 3, g) for b in (1, 2, 4) for w in (1, 2, 3, 4) for g in (True, False)} <= set(proposer.round_fn.graphs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_tree_graphs_token_identical_to_eager(ckpt_a, gpu_heads, method, temperature):
    prompts = word_prompts(ckpt_a, 3)
    params = [SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=s) for s in range(3)]
    eager, _ = _outputs(ckpt_a, gpu_heads[method], method, False, prompts, params, spec_tree="2,2,1")
    graphed, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params, spec_tree="2,2,1")
    assert graphed == eager
    runner = llm.engine.runner
    assert runner.forward_fn.replays > 0  # the verification blocks replayed their graphs
    assert runner.speculation.proposer.round_fn.graphs == {}  # no chain rounds captured for a tree
    assert runner.stats.drafts > 0


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_through_compiled_kernels_matches_eager(ckpt_a, gpu_heads, method, rows):
    target = load_model(str(ckpt_a), dtype="bfloat16", device="cuda")[0]
    head = load_eagle_head(str(gpu_heads[method]), method, target)
    fused = compiled_kernels(("test-head", method))
    gen = torch.Generator(device="cuda").manual_seed(rows)
    ids = torch.randint(0, target.config.vocab_size, (rows, 1), device="cuda", generator=gen)
    positions = torch.randint(0, 100, (rows, 1), device="cuda", generator=gen)
    width = target.config.hidden_size * (1 if method == "eagle" else 3)
    captured = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    outs = []
    with torch.no_grad():
        for kernels in (fused, EAGER):
            features = head.combine(captured, kernels)[:, None]  # [rows, 1, H]
            x = head(ids, features, positions, NoCacheView(), kernels)
            outs.append((features, x, head.logits(x[:, 0], kernels)))
    for got, want in zip(*outs, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        torch.testing.assert_close(got[finite], want[finite], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_rounds_run_their_fused_bundle(ckpt_a, gpu_heads, method):
    prompts = word_prompts(ckpt_a, 3)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    eager, eager_llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params)
    fused, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params, compile_kernels=True)
    runner = llm.engine.runner
    proposer = runner.speculation.proposer
    assert proposer.round_fn.kernels.name == "fused" and proposer.round_fn.kernels is not runner.kernels
    assert eager_llm.engine.runner.speculation.proposer.round_fn.kernels is EAGER
    assert proposer.round_fn.replays > 0
    assert fused == eager  # float32: every projection on the library route, the rotary + KV write bit-identical
    assert runner.stats.accepted_tokens == eager_llm.engine.runner.stats.accepted_tokens
