"""Losslessness end to end: with sampling, speculative decoding must produce exactly the
target's distribution. On a 4-token vocabulary we compute the exact joint distribution of
the first 3 generated tokens from the target model and compare the empirical distribution
of thousands of seeded generations against it (total variation). A negative control, a
verifier that accepts every draft, must fail the same test.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers.checkpoints import hf_config, write_tokenizer
from infer import SamplingParams
from infer.models.loader import load_model
from infer.sampling import logits_to_probs

VOCAB = 4
PROMPT = [2, 3, 2]
N = 6000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03


def _tiny(directory, seed, layers=2):
    _, bos, eos = write_tokenizer(directory)
    torch.manual_seed(seed)
    HFLlama(hf_config("b", VOCAB, 0, 1, num_hidden_layers=layers)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return (_tiny(tmp_path_factory.mktemp("t"), seed=1), _tiny(tmp_path_factory.mktemp("d"), seed=2, layers=1))


def _exact_joint(model_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    model, _ = load_model(str(model_dir), dtype="float32")
    joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=3):
            p = 1.0
            for i in range(3):
                ctx = PROMPT + list(seq[:i])
                logits = model(torch.tensor([ctx]))[:, -1]
                p *= logits_to_probs(logits, [params], [ctx])[0, seq[i]].item()
            joint[seq] = p
    return joint


def _empirical(llm, params: SamplingParams) -> dict[tuple[int, ...], float]:
    plist = [replace(params, max_tokens=4, ignore_eos=True, seed=s) for s in range(N)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=plist)
    counts: dict[tuple[int, ...], float] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1 / N
    return counts


def _tv(a, b):
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


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
    assert _tv(_empirical(llm, PARAMS[name]), exact) < TV_LIMIT
    assert llm.engine.runner.stats.acceptance_rate < 0.95  # the draft really differs


def test_ngram_one_hot_drafts_lossless(make_llm, pair):
    target, _ = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   speculative_method="prompt_lookup", ngram_min_order=2, spec_length=3)
    assert _tv(_empirical(llm, PARAMS["t1"]), exact) < TV_LIMIT
    assert llm.engine.runner.stats.draft_tokens > 0


def test_negative_control_accept_all_fails(make_llm, pair, monkeypatch):
    # both verification paths (fused and general) end in rejection.verify_tensors
    import infer.speculative.rejection as rejection
    real_verify = rejection.verify_tensors

    def accept_all(draft_tokens, counts, draft_probs, target_probs, accept_u, sample_u):
        # u = 0 passes every acceptance test; the bonus token is still sampled from p
        return real_verify(draft_tokens, counts, draft_probs, target_probs, torch.zeros_like(accept_u), sample_u)

    monkeypatch.setattr(rejection, "verify_tensors", accept_all)
    target, draft = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3)
    assert _tv(_empirical(llm, PARAMS["t1"]), exact) > TV_LIMIT


def test_an_fp8_draft_stays_lossless(make_llm, pair):
    # the draft's weights in FP8 change its proposals, never the output distribution
    target, draft = pair
    exact = _exact_joint(target, PARAMS["t1"])
    llm = make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                   draft_model=str(draft), spec_length=3, draft_quantization="fp8")
    assert _tv(_empirical(llm, PARAMS["t1"]), exact) < TV_LIMIT
    assert llm.engine.models.draft.quantization == "fp8" and llm.engine.models.target.quantization is None
