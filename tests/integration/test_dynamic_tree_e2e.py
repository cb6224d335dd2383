"""Dynamic trees end to end (spec_tree="dynamic:N:B"; CPU, tiny checkpoints).

Greedy parity with plain decoding at batch 1 and 4 (a self-draft and an unrelated draft,
both backends); greedy rows keep plain decoding's tokens in a batch with sampled rows
(temperature, top-k with a penalty); the draft's cache holds the accepted path in sequence
order after each round (a self-draft's K/V rows equal the target's); on a 4-token
vocabulary the first three sampled tokens follow the target's exact joint distribution,
and the same check fails when sampled nodes are kept by their own path probability (the
negative control). Every engine is leak-checked (`make_llm`).
"""

from __future__ import annotations

import pytest
import torch
from helpers.joint import empirical_joint, exact_joint, seeded, tiny_pair, total_variation
from helpers.spec_e2e import GREEDY, run

from infer import SamplingParams

TREE = "dynamic:8:3"


def _llm(make_llm, target, draft, batch, tree=TREE, **extra):
    kw = dict(max_batch_size=batch, max_seq_len=256, use_speculative_decoding=True, spec_tree=tree, spec_length=4,
              draft_model=str(draft), **extra)
    return make_llm(target, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("batch, backend", [(1, "contiguous"), (4, "paged")])
def test_greedy_parity_with_plain_decoding(make_llm, ckpt_a, random_draft, prompts, plain_outputs, batch, backend):
    for draft in (ckpt_a, random_draft):
        llm = _llm(make_llm, ckpt_a, draft, batch, kv_cache_backend=backend, block_size=4)
        assert _tokens(run(llm, prompts, batch)) == plain_outputs
        stats = llm.engine.runner.stats
        assert stats.drafts > 0 and stats.draft_tokens > stats.drafts * 4  # trees, not chains
        if draft == ckpt_a:
            assert max(i for i, n in enumerate(stats.accepted_lengths) if n) >= 3  # deep paths accepted


def test_mixed_batch_greedy_rows_keep_their_tokens(make_llm, ckpt_a, prompts, plain_outputs):
    sampled = [SamplingParams(temperature=0.8, max_tokens=GREEDY.max_tokens, seed=1, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.5, max_tokens=GREEDY.max_tokens, seed=2,
                              ignore_eos=True)]
    params = [GREEDY, sampled[0], GREEDY, sampled[1]]
    llm = _llm(make_llm, ckpt_a, ckpt_a, 4, kv_cache_backend="paged", block_size=4)
    outs = _tokens(llm.generate(prompt_token_ids=prompts[:4], sampling_params=params))
    assert outs[0] == plain_outputs[0] and outs[2] == plain_outputs[2]
    assert all(len(t) == GREEDY.max_tokens for t in outs)
    again = _tokens(_llm(make_llm, ckpt_a, ckpt_a, 1).generate(prompt_token_ids=[prompts[1]],
                                                               sampling_params=[sampled[0]]))
    assert again[0] == outs[1]  # a seeded row's tokens do not depend on its batch


def test_sampled_rows_drafting_shallower_than_greedy_rows(make_llm, ckpt_a, prompts, plain_outputs):
    # a sampled row near its max_tokens drafts one level while greedy rows go deeper: the
    # deeper levels then hold greedy rows only, yet the round keeps q for every level
    short = SamplingParams(temperature=1.0, max_tokens=3, seed=4, ignore_eos=True)
    params = [GREEDY, short, GREEDY, short]
    llm = _llm(make_llm, ckpt_a, ckpt_a, 4, kv_cache_backend="paged", block_size=1)
    outs = _tokens(llm.generate(prompt_token_ids=prompts[:4], sampling_params=params))
    assert outs[0] == plain_outputs[0] and outs[2] == plain_outputs[2]
    assert [len(t) for t in outs] == [GREEDY.max_tokens, 3, GREEDY.max_tokens, 3]
    assert llm.engine.runner.stats.rounds > 0


def test_draft_cache_holds_the_accepted_path_in_order(make_llm, ckpt_a, prompts, monkeypatch):
    from infer.speculative.draft_model import DraftModelProposer
    checked = []
    real = DraftModelProposer.on_accepted

    def compare(self, requests, paths):
        real(self, requests, paths)
        target = llm.engine.runner.cache_pool
        for r in requests:
            slot = self.slot(r)
            end = self.pool.seq_len(slot)
            rows_d = self.pool.rows(slot, 0, end)
            rows_t = target.rows(r.slot, 0, end)
            assert torch.allclose(self.pool.k_cache[:, rows_d], target.k_cache[:, rows_t], atol=1e-5)
            checked.append(len(paths))

    monkeypatch.setattr(DraftModelProposer, "on_accepted", compare)
    llm = _llm(make_llm, ckpt_a, ckpt_a, 4, kv_cache_backend="contiguous")
    run(llm, prompts[:4], 4)
    assert checked and llm.engine.runner.stats.accepted_tokens > len(checked)


# -- sampling is lossless ---------------------------------------------------------------------
VOCAB = 4
PROMPT = [2, 3, 2]
N = 3000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 3000 is about 0.042


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, VOCAB)


def _sampled_tv(make_llm, pair) -> float:
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, PROMPT, params, VOCAB)
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    llm = make_llm(target, max_batch_size=64, max_seq_len=24, use_speculative_decoding=True, spec_tree="dynamic:4:2",
                   spec_length=3, draft_model=str(draft))
    outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=seeded(params, N))
    stats = llm.engine.runner.stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    return total_variation(empirical_joint(outs), exact)


def test_first_three_tokens_match_the_target(make_llm, pair):
    assert _sampled_tv(make_llm, pair) < TV_LIMIT


def test_negative_control_keeping_nodes_by_their_own_path_probability_fails(make_llm, pair, monkeypatch):
    import infer.speculative.dynamic_draft as dynamic_draft
    from helpers.dynamic_harness import own_path_scores
    monkeypatch.setattr(dynamic_draft, "slot_scores", own_path_scores)
    assert _sampled_tv(make_llm, pair) > TV_LIMIT
