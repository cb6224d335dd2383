"""A reduced draft vocabulary on the GPU (`pytest -m gpu tests/gpu/test_gpu_draft_vocab.py`).

The draft's gathered lm_head and its spread logits run inside the draft's graphed forward:
CUDA graphs must give the tokens eager execution gives (greedy and seeded sampling, chains
and a static tree), greedy rows plain decoding's, the draft's graphs must replay, and the
compiled kernels (fused GEMV routes of the gathered head) must agree with eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.spec_e2e import generated_tokens, word_prompts
from infer import LLM, SamplingParams
from infer.speculative.draft_vocab import DraftVocab

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KW = dict(device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128, use_speculative_decoding=True,
          spec_batch_gate=False, spec_length=3)


@pytest.mark.parametrize("tree", [None, "2,2,1"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-kernels", "compiled-kernels"])
def test_graphs_match_eager_with_a_reduced_vocabulary(ckpt_a: Path, tmp_path: Path, tree: str | None,
                                                       compiled: bool) -> None:
    table = tmp_path / "table.json"
    DraftVocab(tuple(range(0, 384, 2)), 384, "even ids", 0, 0.0).save(table)
    prompts = word_prompts(ckpt_a, 6, seed=5)
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(KW, draft_model=str(ckpt_a), spec_tree=tree, spec_draft_vocab=str(table), compile_kernels=compiled)
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **dict(kw, compile_kernels=False))
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    plain = LLM(str(ckpt_a), device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128,
                compile_kernels=False)
    want = generated_tokens(plain, prompts, GREEDY)
    assert generated_tokens(graphs, prompts, GREEDY) == generated_tokens(eager, prompts, GREEDY) == want
    if not compiled:  # (fused kernels may round a near-tie differently: greedy parity is what must hold)
        assert generated_tokens(graphs, prompts, sampled) == generated_tokens(eager, prompts, sampled)
    draft = graphs.engine.runner.speculation.draft
    assert draft is not None and draft.step_forward.replays > 0
    assert graphs.engine.models.draft.lm_head.out_features == 192
    stats = graphs.engine.runner.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens < stats.draft_tokens  # (odd ids never proposed)
    for llm in (graphs, eager, plain):
        assert llm.engine.leak_report() == []
