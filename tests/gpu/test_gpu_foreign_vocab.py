"""A draft with another tokenizer on the GPU (`pytest -m gpu tests/gpu/test_gpu_foreign_vocab.py`).

The masked draft forward wraps the draft's graphed forward: CUDA graphs must give the
tokens eager execution gives (greedy and seeded sampling, chains and a static tree), the
draft's graphs must replay, and the target under shuffled ids must accept every draft with
graphs on as without. The adaptive policy's cost measurement at start (GPU only) times a
draft whose vocabulary is smaller than the target's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.foreign_vocab import foreign_draft, permuted_draft
from helpers.spec_e2e import generated_tokens, word_prompts
from infer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128, compile_kernels=False,
          use_speculative_decoding=True, spec_batch_gate=False, spec_length=3)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return foreign_draft(tmp_path_factory.mktemp("foreign"))


@pytest.mark.parametrize("tree", [None, "2,2,1"])
def test_graphs_match_eager_with_a_draft_of_another_tokenizer(ckpt_a: Path, foreign: Path, tree: str | None) -> None:
    prompts = word_prompts(ckpt_a, 6, seed=5)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(KW, draft_model=str(foreign), spec_tree=tree)
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    plain = LLM(str(ckpt_a), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128,
                compile_kernels=False)
    want = generated_tokens(plain, prompts, GREEDY)
    assert generated_tokens(graphs, prompts, GREEDY) == generated_tokens(eager, prompts, GREEDY) == want
    assert generated_tokens(graphs, prompts, sampled) == generated_tokens(eager, prompts, sampled)
    draft = graphs.engine.runner.speculation.draft
    assert draft is not None and draft.step_forward.forward.replays > 0  # (the masked forward's graphs)
    assert graphs.engine.runner.stats.draft_tokens > 0
    for llm in (graphs, eager, plain):
        assert llm.engine.leak_report() == []


def test_the_target_under_shuffled_ids_accepts_its_drafts_in_graphs(ckpt_a: Path, tmp_path: Path) -> None:
    draft = permuted_draft(ckpt_a, tmp_path / "draft")
    llm = LLM(str(ckpt_a), use_cuda_graphs=True, draft_model=str(draft), **KW)
    plain = LLM(str(ckpt_a), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128,
                compile_kernels=False)
    prompts = word_prompts(ckpt_a, 6, seed=5)
    assert generated_tokens(llm, prompts, GREEDY) == generated_tokens(plain, prompts, GREEDY)
    assert llm.engine.runner.stats.acceptance_rate >= 0.99
    assert llm.engine.leak_report() == []


def test_adaptive_policy_times_a_draft_of_a_smaller_vocabulary(ckpt_a: Path, foreign: Path) -> None:
    # the cost measurement at start feeds both models ids below the smaller vocabulary (330)
    llm = LLM(str(ckpt_a), use_cuda_graphs=True, draft_model=str(foreign), **dict(KW, spec_policy="adaptive"))
    assert 0.0 < llm.engine.runner.speculation.policy.config.c < 5.0
    prompts = word_prompts(ckpt_a, 4, seed=5)
    plain = LLM(str(ckpt_a), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128,
                compile_kernels=False)
    assert generated_tokens(llm, prompts, GREEDY) == generated_tokens(plain, prompts, GREEDY)
    assert llm.engine.leak_report() == []
