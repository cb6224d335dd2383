"""Suffix decoding end to end (CPU, tiny checkpoint): greedy parity with plain decoding at
batch 1 and 8 under both KV backends, prefix caching with small prefill chunks and forced
preemption, its rounds verified both as trees and as chains; the cache of finished outputs
drafting for a later request (and nothing of it with spec_suffix_cache_tokens=0);
seeded sampled rows keeping their tokens alone and in a batch without the cache, greedy
rows beside them keeping plain decoding's; tries built under the prefill. Every engine is
leak-checked (`make_llm`)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from helpers.joint import tiny_model
from helpers.spec_e2e import DEPTH, ENGINE_CONFIGS, GREEDY, count_routes, plain_greedy, run
from infer import SamplingParams


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A 4-token model and prompts of its tokens 2 and 3: repeats that go on several ways
    (trees), with their plain greedy outputs."""
    ckpt = tiny_model(tmp_path_factory.mktemp("vocab4"), vocab=4, seed=5)
    rng = random.Random(0)
    prompts = [[0] + [rng.choice((2, 3)) for _ in range(rng.randint(4, 14))] for _ in range(8)]
    return ckpt, prompts, plain_greedy(ckpt, prompts)


def _suffix_llm(make_llm, ckpt, batch, **extra):
    kw = dict(max_batch_size=batch, max_seq_len=256, speculative_method="suffix", spec_length=DEPTH,
              spec_tree="dynamic:8:2", **extra)
    return make_llm(ckpt, **kw)


@pytest.fixture
def rounds(monkeypatch):
    return count_routes(monkeypatch)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity(make_llm, ckpt_a, prompts, plain_outputs, config, batch):
    llm = _suffix_llm(make_llm, ckpt_a, batch, **ENGINE_CONFIGS[config])
    assert _tokens(run(llm, prompts, batch)) == plain_outputs
    stats = llm.engine.runner.stats
    assert stats.drafts > 0 and stats.accepted_tokens > 0
    if config == "paged-preempt" and batch == 8:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("config", ["contiguous", "paged-prefix-small-chunks"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_through_tree_rounds(make_llm, small_vocab, rounds, config, batch):
    ckpt, prompts, plain = small_vocab
    llm = _suffix_llm(make_llm, ckpt, batch, **ENGINE_CONFIGS[config])
    assert _tokens(run(llm, prompts, batch)) == plain
    assert rounds["tree"] > 0 and rounds["chain"] > 0


def test_a_finished_output_drafts_for_a_later_request(make_llm, ckpt_a, prompts, plain_outputs):
    rounds = {}
    for cache in (0, 4096):
        llm = _suffix_llm(make_llm, ckpt_a, 1, spec_suffix_cache_tokens=cache)
        first = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=GREEDY)
        before = llm.engine.runner.stats.rounds
        again = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=GREEDY)
        assert _tokens(first) == _tokens(again) == plain_outputs[:1]
        rounds[cache] = llm.engine.runner.stats.rounds - before
        assert len(llm.engine.runner.speculation.proposer.cache) == (2 if cache else 0)
    assert rounds[4096] < rounds[0]  # the repeat drafts its whole output from the first one's


def test_seeded_rows_keep_their_tokens_alone_and_in_a_batch(make_llm, small_vocab, rounds):
    ckpt_a, prompts, plain_outputs = small_vocab
    sampled = SamplingParams(temperature=0.6, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    params = [GREEDY if i % 4 == 0 else replace(sampled, seed=100 + i) for i in range(len(prompts))]
    batch = _suffix_llm(make_llm, ckpt_a, len(prompts), spec_suffix_cache_tokens=0)
    together = _tokens(batch.generate(prompt_token_ids=prompts, sampling_params=params))
    alone = _suffix_llm(make_llm, ckpt_a, 1, spec_suffix_cache_tokens=0)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        (out,) = alone.generate(prompt_token_ids=[p], sampling_params=sp)
        assert out.outputs[0].token_ids == together[i], i
        if sp.greedy:
            assert together[i] == plain_outputs[i]
    assert rounds["tree"] > 0 and batch.engine.runner.stats.drafts > 0


def test_tries_are_built_under_the_prefill(make_llm, ckpt_a, prompts, monkeypatch):
    llm = _suffix_llm(make_llm, ckpt_a, 1, max_num_batched_tokens=8)
    proposer = llm.engine.runner.speculation.proposer
    sizes = []
    real = proposer.prefilled

    def prefilled(requests):
        real(requests)
        sizes.extend(len(proposer.trie(r.request_id).tokens(0)) for r in requests)

    monkeypatch.setattr(proposer, "prefilled", prefilled)
    prompt = max(prompts, key=len)
    llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
    assert len(prompt) > 8 and sizes and sizes[0] == len(prompt)  # the whole prompt, at its first chunk
