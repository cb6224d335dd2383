"""GPU tests of EAGLE heads (run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_eagle.py`).

A head's rounds replayed as CUDA graphs (engine/executor/head_graphs.py) give the same greedy
tokens as the eager head, EAGLE and EAGLE-3, batch 1 and a batch that pads to a bucket, and
seeded sampled rounds the same tokens as well; a static tree (eager head levels, the
target's verification as a CUDA graph in its greedy or "draft_probs" mode) the same tokens
as without graphs; nothing leaks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.eagle_heads import write_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_heads(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_heads")
    return {"eagle3": write_head(root / "eagle3", ckpt_a, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1]),
            "eagle": write_head(root / "eagle", ckpt_a, "eagle", fc_bias=True)}


def _outputs(ckpt: Path, head: Path, method: str, graphs: bool, prompts: list[list[int]],
             params: list[SamplingParams], **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256, compile_kernels=False,
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
    assert runner.forward.tree_replays > 0 and runner.forward.verify_replays > 0  # the verifier's graph
    assert runner.speculation.proposer.round_fn.graphs == {}  # no chain rounds captured for a tree
    assert runner.stats.drafts > 0
