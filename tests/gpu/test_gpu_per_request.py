"""GPU tests of per-request speculation (`pytest -m gpu tests/gpu/test_gpu_per_request.py`).

Rows with `speculation` off, at 2 and at the engine's K (3) in one batch, with CUDA graphs
and overlapped scheduling (the GPU defaults): each greedy row gives plain decoding's tokens,
the seeded rows give what an eager synchronous engine gives, and every row alone what it
gives in the batch; a draft model, n-gram tables and an EAGLE-3 head, chains and a draft
model's static tree (greedy only there: its seeded rows are not promised across batch
shapes, docs/architecture.md); nothing leaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.eagle_heads import write_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SPECS = (False, 2, None)
TOKENS = 24


@pytest.fixture(scope="module")
def head(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("gpu_head") / "eagle3", ckpt_a, "eagle3", draft_vocab=120,
                      aux_layers=[0, 1, 1])


def _params(spec: bool | int | None, seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=TOKENS, ignore_eos=True,
                          speculation=spec)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.leak_report() == []
    return outs


def _llm(ckpt: Path, graphs: bool, **spec: Any) -> LLM:
    return LLM(str(ckpt), device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256, use_cuda_graphs=graphs,
               async_scheduling=graphs, compile_kernels=False, **spec)


@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle3", "draft_tree"])
def test_rows_off_at_two_and_at_k_under_graphs(ckpt_a: Path, head: Path, method: str) -> None:
    spec: dict[str, Any] = dict(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3,
                                speculative_method="draft_model" if method == "draft_tree" else method)
    if method in ("draft_model", "draft_tree"):
        spec["draft_model"] = str(ckpt_a)
    if method == "eagle3":
        spec["draft_model"] = str(head)
    if method == "draft_tree":
        spec["spec_tree"] = "2,2,1"
    prompts = word_prompts(ckpt_a, len(SPECS))
    plain = _tokens(_llm(ckpt_a, True), prompts, [_params(None, None)] * len(SPECS))
    graphed, eager = _llm(ckpt_a, True, **spec), _llm(ckpt_a, False, **spec)
    assert _tokens(graphed, prompts, [_params(s, None) for s in SPECS]) == plain
    assert graphed.engine.runner.forward_fn.replays > 0
    seeds = [_params(s, 10 + i) for i, s in enumerate(SPECS)]
    batched = _tokens(graphed, prompts, seeds)
    if method != "draft_tree":
        assert batched == _tokens(eager, prompts, seeds)
        for prompt, params, tokens in zip(prompts, seeds, batched, strict=True):
            assert _tokens(graphed, [prompt], [params]) == [tokens], params.speculation
    else:
        assert _tokens(graphed, prompts[:1], seeds[:1]) == batched[:1]  # the plain row alone
