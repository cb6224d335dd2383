"""A reduced draft vocabulary on the GPU (`pytest -m gpu tests/gpu/test_gpu_draft_vocab.py`).

The draft's gathered lm_head and its spread logits run inside the draft's graphed forward:
CUDA graphs must give the tokens eager execution gives (greedy and seeded sampling, chains
and a static tree), greedy rows plain decoding's, the draft's graphs must replay, and the
compiled kernels (fused GEMV routes of the gathered head) must agree with eager.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from helpers.checkpoints import encode
from infer import LLM, SamplingParams
from infer.speculative.draft_vocab import DraftVocab

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128, use_speculative_decoding=True,
          spec_length=3)


def _prompts(model_dir: Path, n: int = 6) -> list[list[int]]:
    rng = random.Random(5)
    words = "the cat sat on the mat and a dog ran to the park while birds sang".split()
    return [encode(model_dir, " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))) for _ in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY
            ) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("tree", [None, "2,2,1"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-kernels", "compiled-kernels"])
def test_graphs_match_eager_with_a_reduced_vocabulary(ckpt_a: Path, tmp_path: Path, tree: str | None,
                                                       compiled: bool) -> None:
    table = tmp_path / "table.json"
    DraftVocab(tuple(range(0, 384, 2)), 384, "even ids", 0, 0.0).save(table)
    prompts = _prompts(ckpt_a)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(KW, draft_model=str(ckpt_a), spec_tree=tree, spec_draft_vocab=str(table), compile_kernels=compiled)
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **dict(kw, compile_kernels=False))
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    plain = LLM(str(ckpt_a), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128,
                compile_kernels=False)
    assert _tokens(graphs, prompts) == _tokens(eager, prompts) == _tokens(plain, prompts)
    if not compiled:  # (fused kernels may round a near-tie differently: greedy parity is what must hold)
        assert _tokens(graphs, prompts, sampled) == _tokens(eager, prompts, sampled)
    draft = graphs.engine.runner.speculation.draft
    assert draft is not None and draft.step_forward.forward.replays > 0
    assert graphs.engine.models.draft.lm_head.out_features == 192
    stats = graphs.engine.runner.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens < stats.draft_tokens  # (odd ids never proposed)
    for llm in (graphs, eager, plain):
        assert llm.engine.leak_report() == []
