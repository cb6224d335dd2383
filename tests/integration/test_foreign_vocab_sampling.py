"""Losslessness with a draft of another tokenizer: on four-token vocabularies sharing two
tokens at other ids (helpers/foreign_vocab.py: the target's "ab" reaches the draft as two
tokens, its "d" as none, the draft's "x" and "y" are not the target's), the empirical joint
distribution of the first three sampled tokens must match the target's exact one (total
variation), for chains and a static tree. Negative controls: drafting without masking the
tokens the target lacks, and proposals mapped to the wrong target ids, fail the same bound.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.foreign_vocab import tiny_pair
from helpers.joint import empirical_joint, exact_joint, seeded, total_variation
from infer import SamplingParams
from infer.speculative.foreign_draft import ForeignDraftProposer, MaskedForward

VOCAB = 4
PROMPT = [0, 3, 1]  # "a" "d" "b": the draft reads "a" "b"
N = 6000
N_CONTROL = 3000  # the controls miss by far more than the noise (about 0.04 at 3000)
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03
T1 = SamplingParams(temperature=1.0)
PENALISED = SamplingParams(temperature=1.0, presence_penalty=0.9, frequency_penalty=0.6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory)


def _llm(make_llm, pair, **extra):
    target, draft = pair
    return make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                    draft_model=str(draft), spec_length=3, **extra)


def _tv(llm, target, params: SamplingParams, n: int = N) -> float:
    exact = exact_joint(target, PROMPT, params, VOCAB)
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    outputs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=seeded(params, n))
    return total_variation(empirical_joint(outputs), exact)


@pytest.mark.parametrize(("shape", "params"), [(None, T1), (None, PENALISED), ("2,1,1", T1)],
                         ids=["chain", "chain-penalties", "tree"])
def test_first_three_tokens_match_target(make_llm, pair, shape, params):
    llm = _llm(make_llm, pair, spec_tree=shape)
    assert isinstance(llm.engine.runner.speculation.proposer, ForeignDraftProposer)
    assert llm.engine.runner.stats.shared_vocabulary == 0.5
    assert _tv(llm, pair[0], params) < TV_LIMIT
    stats = llm.engine.runner.stats
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < 0.95 * stats.draft_tokens


def test_negative_control_without_the_mask_fails(make_llm, pair, monkeypatch):
    # the draft samples its whole vocabulary: a token the target lacks ends the chain there,
    # and the shared tokens' q no longer sums to 1
    monkeypatch.setattr(MaskedForward, "run", lambda self, plan, device_ids=None: self.forward.run(plan, device_ids))
    assert _tv(_llm(make_llm, pair), pair[0], T1, N_CONTROL) > TV_LIMIT


def test_negative_control_wrong_mapping_fails(make_llm, pair):
    # "a" and "b" proposed as each other, their q left at the right columns
    llm = _llm(make_llm, pair)
    proposer = llm.engine.runner.speculation.proposer
    right = proposer.vocab.draft_to_target
    swap = {0: 1, 1: 0}
    proposer.vocab = replace(proposer.vocab, draft_to_target=tuple(swap.get(t, t) for t in right))
    assert _tv(llm, pair[0], T1, N_CONTROL) > TV_LIMIT
