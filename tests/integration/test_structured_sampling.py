"""Losslessness under a grammar: speculative sampling under a structured output gives the
same distribution as the target's sampling under it, the target's distribution restricted
to the tokens the grammar allows.

On a 4-token vocabulary (0 BOS, 1 EOS, 2 = "!", 3 = '"') the regex `(!"|"){3,}` allows,
within the first three tokens, '"' after "!" and both "!" and '"' elsewhere (EOS only
after three groups, never within three tokens). The exact joint distribution of the first
three tokens under that mask is enumerated from the target; thousands of seeded
speculative generations must match it in total variation. A negative control (a verifier
that accepts every draft the grammar allows) fails the same test. The grammar's state
rolls back over rejected drafts: every output is a string the grammar accepts.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from helpers.joint import empirical_joint, tiny_pair, total_variation  # noqa: E402
from infer import SamplingParams  # noqa: E402
from infer.models.loading.loader import load_model  # noqa: E402
from infer.sampling import StructuredOutput, logits_to_probs  # noqa: E402

VOCAB = 4
PROMPT = [2, 3, 2]
N = 4000
TV_LIMIT = 0.07  # sampling noise over a handful of cells at N = 4000 is about 0.02
REGEX = '(!"|"){3,}'
BANG, QUOTE = 2, 3


def _allowed(prefix: tuple[int, ...]) -> list[int]:
    """The tokens the regex allows after `prefix` (within the first three tokens)."""
    return [QUOTE] if prefix and prefix[-1] == BANG else [BANG, QUOTE]


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=4, structured=StructuredOutput(regex=REGEX))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, VOCAB)


def _exact_masked_joint(model_dir) -> dict[tuple[int, ...], float]:
    model, _ = load_model(str(model_dir), dtype="float32")
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=3):
            p = 1.0
            for i in range(3):
                ctx = PROMPT + list(seq[:i])
                logits = model(torch.tensor([ctx]))[:, -1]  # [1, V]
                masked = torch.full_like(logits, float("-inf"))
                allowed = _allowed(seq[:i])
                masked[:, allowed] = logits[:, allowed]
                p *= logits_to_probs(masked, [SamplingParams(temperature=1.0)], None)[0, seq[i]].item()
            joint[seq] = p
    return joint


def _speculative(make_llm, draft):
    return make_llm(draft[0], max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                    draft_model=str(draft[1]), spec_length=3)


def _generate(llm):
    return llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=[_params(s) for s in range(N)])


def test_speculative_sampling_under_a_grammar_matches_the_masked_target(make_llm, pair):
    exact = _exact_masked_joint(pair[0])
    assert max(exact.values()) < 0.6, "distribution too peaked to be a meaningful test"
    plain = _generate(make_llm(pair[0], max_batch_size=64, max_seq_len=16))
    llm = _speculative(make_llm, pair)
    spec = _generate(llm)
    assert total_variation(empirical_joint(plain), exact) < TV_LIMIT
    assert total_variation(empirical_joint(spec), exact) < TV_LIMIT
    stats = llm.engine.runner.stats
    assert stats.draft_tokens > 0 and 0 < stats.acceptance_rate < 0.95  # drafts accepted and rejected
    # the grammar rolled back over every rejected draft: each output is a string it accepts
    for out in spec[:500]:
        ids = out.outputs[0].token_ids
        text = "".join({BANG: "!", QUOTE: '"'}[t] for t in ids if t != 1)
        assert all(t in (BANG, QUOTE, 1) for t in ids)
        assert re.fullmatch(r'(!"|")*!?', text), ids
        if ids[-1] == 1:  # EOS only once the grammar is complete
            assert re.fullmatch(REGEX, text), ids


def test_negative_control_accept_all_fails(make_llm, pair, monkeypatch):
    import infer.speculative.verifier as verifier
    real_verify = verifier.verify_tensors

    def accept_all(draft_tokens, counts, draft_probs, target_probs, accept_u, sample_u):
        # u = 0 accepts every draft of positive target probability (the ones the grammar allows)
        return real_verify(draft_tokens, counts, draft_probs, target_probs, torch.zeros_like(accept_u), sample_u)

    monkeypatch.setattr(verifier, "verify_tensors", accept_all)
    exact = _exact_masked_joint(pair[0])
    assert total_variation(empirical_joint(_generate(_speculative(make_llm, pair))), exact) > TV_LIMIT
