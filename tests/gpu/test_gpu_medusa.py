"""GPU tests of Medusa heads (run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_medusa.py`).

The target in CUDA graphs (its captured hidden states a static output of the graph) beside
the heads' eager call: greedy tokens as plain decoding with graphs, chains and static trees,
dense and FP8 heads, and seeded sampled rows the same with graphs as without (float32);
nothing leaks. The heads through the compiled fused bundle (one-row projections on the GEMV)
give EAGER's logits to bf16 rounding. Dummy heads of the 3B shape load and time (c is
measured, never asserted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.medusa_heads import write_medusa_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams
from infer.engine.step_costs import StepCostConfig, measure_model_costs
from infer.models.kernels.bundle import EAGER
from infer.models.loading.dummy_heads import dummy_medusa_config, dummy_medusa_head
from infer.models.loading.loader import load_model
from infer.models.loading.medusa_files import load_medusa_head

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def heads(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_medusa_head(tmp_path_factory.mktemp("gpu_medusa"), ckpt_a, 4, 1, copy_lm_head=True)


def _outputs(ckpt: Path, graphs: bool, prompts: list[list[int]], params: list[SamplingParams], dtype: str,
             **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(ckpt), device="cuda", dtype=dtype, max_batch_size=4, max_seq_len=256, use_cuda_graphs=graphs,
              **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.leak_report() == []
    return outs, llm


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("tree", [None, "3,2,2"])
def test_greedy_parity_with_graphs(ckpt_a, heads, tree, quantization):
    prompts = word_prompts(ckpt_a, 4)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 4
    plain, _ = _outputs(ckpt_a, True, prompts, params, "float32")
    spec = {"spec_tree": tree} if tree else {"spec_length": 4}
    medusa, llm = _outputs(ckpt_a, True, prompts, params, "float32", speculative_method="medusa",
                           spec_batch_gate=False, draft_model=str(heads), draft_quantization=quantization, **spec)
    assert medusa == plain
    runner = llm.engine.runner
    assert runner.forward_fn.replays > 0 and runner.stats.drafts > 0
    assert runner.speculation.proposer.kernels.name == "fused"  # (the heads' own compiled bundle)


def test_seeded_rows_same_with_graphs(ckpt_a, heads):
    prompts = word_prompts(ckpt_a, 4)
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=s) for s in range(4)]
    options = dict(speculative_method="medusa", spec_batch_gate=False, draft_model=str(heads), spec_tree="2,2",
                   compile_kernels=False)
    eager, _ = _outputs(ckpt_a, False, prompts, params, "float32", **options)
    graphed, llm = _outputs(ckpt_a, True, prompts, params, "float32", **options)
    assert graphed == eager
    assert llm.engine.runner.forward_fn.replays > 0


def test_heads_through_compiled_kernels_match_eager(ckpt_a, heads):
    target = load_model(str(ckpt_a), dtype="bfloat16", device="cuda")[0]
    head = load_medusa_head(str(heads), target.config, torch.bfloat16, torch.device("cuda"))
    fused = head.compiled.get()  # the heads' own bundle, as the engine gives them
    for rows in (1, 3):
        hidden = torch.randn(rows, target.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for k in range(4):
                torch.testing.assert_close(head.logits(k, hidden, fused).float(), head.logits(k, hidden, EAGER).float(),
                                           rtol=2e-2, atol=2e-2)


def test_dummy_heads_of_the_3b_shape_time(tmp_path):
    """The costs suite's Medusa row on its own: dummy heads of the 3B shape load (bf16 and
    FP8) and their step is timed through the fused bundle."""
    target = load_model("dummy:llama-3.2-3b", dtype="bfloat16", device="cuda")[0]
    spec = dummy_medusa_config("dummy-medusa:llama-3.2-3b")
    for quantization in (None, "fp8"):
        head = dummy_medusa_head(spec, torch.bfloat16, torch.device("cuda"), quantization)
        costs = measure_model_costs(target, None, True, StepCostConfig(repeats=5, warmup=2), head)
        assert costs.c is not None and costs.c > 0 and costs.draft_fixed_s is not None
        del head
        torch.cuda.empty_cache()
