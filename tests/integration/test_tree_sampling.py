"""Tree speculation is lossless end to end: on a 4-token vocabulary the empirical joint
distribution of the first 3 generated tokens over thousands of seeded requests must match
the target's exact joint distribution (total variation within sampling noise), for the
temperature-only path, the general pipeline (top-k, presence / frequency penalties), model
drafts with duplicate children and n-gram trees with one-hot q; greedy requests sharing
the batch keep plain decoding's tokens. A verifier that always accepts the first child
fails the same test.
"""

from __future__ import annotations

import pytest

from helpers.joint import empirical_joint, exact_joint, force_first_child, seeded, tiny_pair, total_variation
from helpers.spec_e2e import count_routes
from infer import SamplingParams

VOCAB = 4
PROMPT = [2, 3, 2]
N = 6000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, VOCAB)


def _tree_llm(make_llm, target, draft, tree, **extra):
    kw = dict(max_batch_size=64, max_seq_len=24, use_speculative_decoding=True, spec_tree=tree, **extra)
    if kw.get("speculative_method", "draft_model") == "draft_model":
        kw["draft_model"] = str(draft)
    return make_llm(target, **kw)


CASES = {
    # name: (sampling params, tree, engine options)
    "t1-3x2": (SamplingParams(temperature=1.0), "3,2", {}),
    "t0.7-topk3-2x2x1": (SamplingParams(temperature=0.7, top_k=3), "2,2,1", {"kv_cache_backend": "contiguous"}),
    "t1-presence-frequency-3x1": (SamplingParams(temperature=1.0, presence_penalty=0.9, frequency_penalty=0.6),
                                  "3,1", {}),
    "t1-prompt-lookup-2x2": (SamplingParams(temperature=1.0), "2,2",
                             {"speculative_method": "prompt_lookup", "ngram_min_order": 2}),
    # suffix decoding: trees grown from the requests' own tokens and the finished ones' (its
    # rounds verified as trees, and as chains when every row's draft is a path)
    "t1-suffix-dynamic-6x2": (SamplingParams(temperature=1.0), "dynamic:6:2",
                              {"speculative_method": "suffix", "spec_length": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_three_tokens_match_target(make_llm, pair, name, monkeypatch):
    target, draft = pair
    params, tree, extra = CASES[name]
    routes = count_routes(monkeypatch)
    exact = exact_joint(target, PROMPT, params, VOCAB)
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    llm = _tree_llm(make_llm, target, draft, tree, **extra)
    greedy_ref = make_llm(target, max_seq_len=24).generate(prompt_token_ids=[PROMPT], sampling_params=GREEDY)
    # every 50th request greedy, in the same batches as the sampled ones
    plist = [GREEDY if i % 50 == 0 else p for i, p in enumerate(seeded(params, N))]
    outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=plist)
    sampled = [o for i, o in enumerate(outs) if i % 50]
    assert total_variation(empirical_joint(sampled), exact) < TV_LIMIT
    assert all(o.outputs[0].token_ids == greedy_ref[0].outputs[0].token_ids for o in outs[::50])
    stats = llm.engine.runner.stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < sum(stats.drafted_per_position)  # some, not all
    if extra.get("speculative_method") == "suffix":
        assert routes["tree"] > 0 and routes["chain"] > 0



def test_negative_control_first_child_always_accepted_fails(make_llm, pair, monkeypatch):
    # uniforms of 0 pass every acceptance test (p > 0 everywhere): the first child is always
    # accepted, the final token is still drawn from the residual
    force_first_child(monkeypatch)
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, PROMPT, params, VOCAB)
    llm = _tree_llm(make_llm, target, draft, "3,2")
    outs = llm.generate(prompt_token_ids=[PROMPT] * N, sampling_params=seeded(params, N))
    assert total_variation(empirical_joint(outs), exact) > TV_LIMIT
