"""Losslessness end to end: with sampling, speculative decoding must produce exactly the
target's distribution. On a 4-token vocabulary we compute the exact joint distribution of
the first 3 generated tokens from the target model and compare the empirical distribution
of thousands of seeded generations against it (total variation). A negative control, a
verifier that accepts every draft, must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from helpers.joint import empirical_joint, exact_joint, seeded, tiny_pair, total_variation
from infer import SamplingParams

VOCAB = 4
PROMPT = [2, 3, 2]
N = 6000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, VOCAB)


def _exact_joint(model_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    return exact_joint(model_dir, PROMPT, params, VOCAB)


def _empirical(llm, params: SamplingParams) -> dict[tuple[int, ...], float]:
    return empirical_joint(llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=seeded(params, N)))


PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1-presence-frequency": SamplingParams(temperature=1.0, presence_penalty=0.9, frequency_penalty=0.6),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_first_three_tokens_match_target(make_llm, pair, name):
    target, draft = pair
    exact = _exact_joint(target, PARAMS[name])
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3)
    assert total_variation(_empirical(llm, PARAMS[name]), exact) < TV_LIMIT
    assert llm.engine.runner.stats.acceptance_rate < 0.95  # the draft really differs


def test_ngram_one_hot_drafts_lossless(make_llm, pair):
    target, _ = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   speculative_method="prompt_lookup", ngram_min_order=2, spec_length=3)
    assert total_variation(_empirical(llm, PARAMS["t1"]), exact) < TV_LIMIT
    assert llm.engine.runner.stats.draft_tokens > 0


def test_negative_control_accept_all_fails(make_llm, pair, monkeypatch):
    # both verification paths (fused and general) end in verifier.verify_tensors
    import infer.speculative.verifier as verifier
    real_verify = verifier.verify_tensors

    def accept_all(draft_tokens, counts, draft_probs, target_probs, accept_u, sample_u):
        # u = 0 passes every acceptance test; the bonus token is still sampled from p
        return real_verify(draft_tokens, counts, draft_probs, target_probs, torch.zeros_like(accept_u), sample_u)

    monkeypatch.setattr(verifier, "verify_tensors", accept_all)
    target, draft = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3)
    assert total_variation(_empirical(llm, PARAMS["t1"]), exact) > TV_LIMIT


def test_an_fp8_draft_stays_lossless(make_llm, pair):
    # the draft's weights in FP8 change its proposals, never the output distribution
    target, draft = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3, draft_quantization="fp8")
    assert total_variation(_empirical(llm, PARAMS["t1"]), exact) < TV_LIMIT
    assert llm.engine.models.draft.quantization == "fp8" and llm.engine.models.target.quantization is None


def _ahead_joint(make_llm, pair, monkeypatch) -> tuple[float, object]:
    """TV of unseeded T=1 requests whose rounds are drafted ahead (K=1: a request's second round
    is drafted under its first's verification, its q kept on the device beside its token).
    Their generators are seeded here from a counter, so the run repeats (the engine still
    sees requests without a seed)."""
    import itertools
    from dataclasses import replace

    import infer.engine.request as request_module
    real, counter = request_module.make_generator, itertools.count()
    monkeypatch.setattr(request_module, "make_generator",
                        lambda seed: real(next(counter) if seed is None else seed))
    target, draft = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=1, spec_batch_gate=False)
    params = replace(PARAMS["t1"], max_tokens=4, ignore_eos=True)  # (no seed: the rows draft ahead)
    outputs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=[params] * N)
    return total_variation(empirical_joint(outputs), exact), llm.engine.runner.speculation.proposer


def test_unseeded_rows_drafted_ahead_stay_lossless(make_llm, pair, monkeypatch):
    tv, proposer = _ahead_joint(make_llm, pair, monkeypatch)
    assert tv < TV_LIMIT and proposer.ahead_rounds > 0


def test_negative_control_rounds_ahead_with_another_q_fail(make_llm, pair, monkeypatch):
    # the rounds drafted ahead verified against a q that gives their drawn token no mass:
    # every such draft is accepted, so those tokens follow the draft's distribution
    import infer.speculative.draft_model as draft_model
    real = draft_model.Draft.chain_on_device

    def other_q(shape, tokens, row, k, probs=None):
        if probs is not None:
            probs = probs.clone()
            probs[torch.arange(k), tokens.tokens[row, :k]] = 0.0
        return real(shape, tokens, row, k, probs)

    monkeypatch.setattr(draft_model.Draft, "chain_on_device", staticmethod(other_q))
    tv, proposer = _ahead_joint(make_llm, pair, monkeypatch)
    assert tv > TV_LIMIT and proposer.ahead_rounds > 0
