"""The Qwen and Mistral families in the engine: a Qwen2.5-style speculation pair (a small tied
draft for a larger untied target, one vocabulary) keeps greedy parity with transformers and
stays lossless under sampling (total variation against the exact joint distribution, as the
Llama pairs in test_speculative_sampling.py), and tensor parallelism (CPU, gloo, 2 ranks)
gives the tokens of one process for Qwen2 (biases split with their rows, a tied
vocabulary-parallel head) and Qwen3 (per-head norms, FP8 weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import hf_greedy, load_hf_model, make_family_checkpoint, mixed_prompts
from helpers.joint import empirical_joint, exact_joint, seeded, tiny_model, total_variation
from helpers.spec_e2e import DEPTH, ENGINE_CONFIGS, MAX_NEW, run, word_prompts
from infer import LLM, SamplingParams

VOCAB = 4
PROMPT = [2, 3, 2]
N = 6000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target: 3 layers, untied, as Qwen2.5-7B; draft: 1 layer, tied, as Qwen2.5-0.5B)."""
    target = make_family_checkpoint(tmp_path_factory.mktemp("qt"), "qwen2", seed=5, num_hidden_layers=3,
                                    intermediate_size=192, tie_word_embeddings=False)
    draft = make_family_checkpoint(tmp_path_factory.mktemp("qd"), "qwen2", seed=6, num_hidden_layers=1)
    return target, draft


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_qwen_pair_greedy_parity(make_llm: Any, qwen_pair: tuple[Path, Path], config: str) -> None:
    target, draft = qwen_pair
    prompts = word_prompts(target, n=4)
    hf = load_hf_model(target)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    llm = make_llm(target, max_seq_len=256, use_speculative_decoding=True, draft_model=str(draft),
                   spec_length=DEPTH, **ENGINE_CONFIGS[config])
    outs = run(llm, prompts, batch=len(prompts), params=params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    stats = llm.engine.runner.stats
    assert stats.draft_tokens > 0 and stats.acceptance_rate < 0.95  # the draft really differs


def test_qwen_pair_sampling_is_lossless(make_llm: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tiny_model(tmp_path_factory.mktemp("t"), VOCAB, seed=1, family="qwen2", layers=2,
                        tie_word_embeddings=False)
    draft = tiny_model(tmp_path_factory.mktemp("d"), VOCAB, seed=2, family="qwen2", layers=1)
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, PROMPT, params, VOCAB)
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3)
    outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=seeded(params, N))
    assert total_variation(empirical_joint(outs), exact) < TV_LIMIT
    assert llm.engine.runner.stats.acceptance_rate < 0.95


def _tokens(model: Path, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(model), device="cpu", max_seq_len=256, **kwargs) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert llm.engine.leak_report() == []
        workers = llm.engine.parallel.workers if llm.engine.parallel is not None else ()
    assert [w.returncode for w in workers] == [0] * len(workers)
    return out


@pytest.mark.parametrize(("family", "quantization"), [("qwen2", None), ("qwen3", "fp8")])
def test_tensor_parallel_gives_one_processes_tokens(tmp_path: Path, family: str, quantization: str | None) -> None:
    ckpt = make_family_checkpoint(tmp_path / family, family)
    prompts = mixed_prompts(ckpt, seed=3)
    one = _tokens(ckpt, prompts, quantization=quantization)
    two = _tokens(ckpt, prompts, quantization=quantization, tensor_parallel_size=2)
    assert two == one and all(len(t) == 12 for t in two)
