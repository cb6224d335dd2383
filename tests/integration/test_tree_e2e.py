"""Tree speculation end to end (issue #37; CPU, tiny checkpoints).

Greedy parity with plain decoding for 8 prompts, batch 1 and 8, both backends, prefix
caching with small prefill chunks, forced preemption; drafted by the target itself (the
full depth accepted every round; also chains and a tree MAX_TREE_DEPTH deep), by an
unrelated random draft, by n-gram and prompt-lookup trees; siblings a one-token draft
cannot fill are absent. The accepted path's K/V moves in both caches (a self-draft whose
children come in reverse rank order still accepts everything), penalties read each node's
own context, mixed greedy / sampled / log-probability rows share a batch, stops inside an
accepted path, the length guards near max_seq_len, metrics, configuration. Every engine is
leak-checked.
"""

from __future__ import annotations

import pytest

from helpers.spec_e2e import DEPTH, ENGINE_CONFIGS, GREEDY, MAX_NEW, run as _run
from infer import EngineConfig, SamplingParams
from infer.speculative.tree import MAX_TREE_DEPTH

TREE = "3,2,1,1"  # 21 nodes, depth 4 (DEPTH)


def _tree_llm(make_llm, target, draft, batch, method="draft_model", tree=TREE, **extra):
    kw = dict(max_batch_size=batch, max_seq_len=256, use_speculative_decoding=True, spec_tree=tree,
              speculative_method=method, **extra)
    if method == "draft_model":
        kw["draft_model"] = str(draft)
    return make_llm(target, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _full_depth_every_round(stats):
    """Every drafting round accepted as deep as it proposed."""
    return stats.drafts > 0 and stats.accepted_tokens == sum(stats.drafted_per_position)


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_self_draft_accepts_the_full_depth(make_llm, ckpt_a, prompts, plain_outputs, config, batch):
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a, batch, **ENGINE_CONFIGS[config])
    outs = _run(llm, prompts, batch)
    assert _tokens(outs) == plain_outputs
    stats = llm.engine.runner.stats
    assert _full_depth_every_round(stats)
    assert stats.accepted_lengths[DEPTH] >= 0.9 * stats.drafts  # (the length guard cuts the last rounds)
    assert stats.draft_tokens > stats.accepted_tokens * 4  # a tree proposes 21 nodes for 4 accepted
    if config == "paged-preempt" and batch == 8:
        assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].acceptance_rate == 1.0 for o in outs)


@pytest.mark.parametrize("tree", [None, "2," + ",".join(["1"] * (MAX_TREE_DEPTH - 1))])
def test_rounds_as_deep_as_max_tree_depth_keep_greedy_parity(make_llm, ckpt_a, prompts, tree):
    # a self-draft's chains of MAX_TREE_DEPTH drafts (and a tree that deep) accept whole rounds
    params = SamplingParams(temperature=0, max_tokens=3 * MAX_TREE_DEPTH, ignore_eos=True)
    plain = _tokens(make_llm(ckpt_a, max_seq_len=256).generate(prompt_token_ids=prompts[:3], sampling_params=params))
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a, 3, tree=tree, spec_length=MAX_TREE_DEPTH)
    assert _tokens(llm.generate(prompt_token_ids=prompts[:3], sampling_params=params)) == plain
    stats = llm.engine.runner.stats
    assert _full_depth_every_round(stats) and stats.accepted_lengths[MAX_TREE_DEPTH] > 0


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_random_draft(make_llm, ckpt_a, random_draft, prompts, plain_outputs, config, batch):
    llm = _tree_llm(make_llm, ckpt_a, random_draft, batch, **ENGINE_CONFIGS[config])
    assert _tokens(_run(llm, prompts, batch)) == plain_outputs
    assert llm.engine.runner.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("method", ["ngram", "prompt_lookup"])
@pytest.mark.parametrize("config", ["contiguous", "paged-prefix-small-chunks"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_ngram_trees(make_llm, ckpt_a, prompts, plain_outputs, method, config, batch):
    llm = _tree_llm(make_llm, ckpt_a, None, batch, method=method, tree="3,2,1", **ENGINE_CONFIGS[config])
    assert _tokens(_run(llm, prompts, batch)) == plain_outputs
    stats = llm.engine.runner.stats
    assert stats.drafts > 0 and stats.accepted_tokens > 0


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_paths_through_last_children_move_both_caches(make_llm, ckpt_a, prompts, plain_outputs, monkeypatch,
                                                      backend):
    # the target drafting for itself with its children in reverse rank order: the accepted
    # child is the last one at every depth, so every accepted node's K/V moves, in the
    # target's cache and in the draft's. A draft cache left unordered would draft wrong
    # tokens in the next round: the full depth is accepted only if both moves are right.
    import infer.cache.compaction as compaction
    import infer.engine.runner as runner_module
    import infer.speculative.draft_model as draft_model
    import infer.speculative.tree_expand as tree_expand
    real_children, real_move = tree_expand.children, compaction.move_paths
    moved = {"target": 0, "draft": 0}

    def reversed_children(logits, params, contexts, width, uniforms):
        kids, q, drawn = real_children(logits, params, contexts, width, uniforms)
        assert q is None and drawn is None  # greedy rows: distinct top tokens, one-hot q
        return kids.view(-1, width).flip(1).reshape(-1), q, drawn

    def counting(key):
        def move(pool, moves):
            n = real_move(pool, moves)
            moved[key] += n
            return n
        return move

    monkeypatch.setattr(tree_expand, "children", reversed_children)
    monkeypatch.setattr(runner_module, "move_paths", counting("target"))
    monkeypatch.setattr(draft_model, "move_paths", counting("draft"))
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a, 8, kv_cache_backend=backend, block_size=4)
    assert _tokens(_run(llm, prompts, 8)) == plain_outputs
    stats = llm.engine.runner.stats
    assert _full_depth_every_round(stats)
    assert moved["target"] == stats.accepted_tokens  # every accepted node moved
    assert 0 < moved["draft"] < moved["target"]  # the draft moves the nodes it was fed (not the leaves)


@pytest.mark.parametrize("draft", ["self", "random"])
def test_greedy_parity_with_repetition_penalty(make_llm, ckpt_a, random_draft, prompts, draft):
    # the penalty reads each node's own context (its path), in the target's verification and
    # in the draft's expansion: a wrong context changes the argmax somewhere
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    ref = _tokens(make_llm(ckpt_a, max_seq_len=256, max_batch_size=8).generate(prompt_token_ids=prompts,
                                                                                 sampling_params=params))
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a if draft == "self" else random_draft, 8)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == ref
    if draft == "self":
        assert _full_depth_every_round(llm.engine.runner.stats)


@pytest.mark.parametrize("batch", [1, 8])
def test_siblings_a_one_token_draft_cannot_fill_are_absent(make_llm, ckpt_a, prompts, plain_outputs, batch):
    # top_k=1 at T=1 samples the argmax, but through the sampled path: the draft draws
    # siblings without replacement from a one-token q, so only each level's first child is
    # present (a chain of DEPTH nodes), and the output is plain greedy decoding's
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True, seed=5)
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a, batch)
    assert _tokens(_run(llm, prompts, batch, params)) == plain_outputs
    stats = llm.engine.runner.stats
    assert _full_depth_every_round(stats)
    assert stats.draft_tokens == sum(stats.drafted_per_position)  # one node a depth: the siblings absent


def test_mixed_rows_share_a_batch(make_llm, ckpt_a, prompts, plain_outputs):
    # greedy, temperature, top-k / top-p, penalised and log-probability rows in one batch:
    # greedy rows keep plain decoding's tokens and log-probabilities; seeded rows replay
    import math
    params = [GREEDY, SamplingParams(temperature=0.8, max_tokens=MAX_NEW, ignore_eos=True, seed=1),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=2),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.2, presence_penalty=0.5, max_tokens=MAX_NEW, ignore_eos=True, seed=3)]
    plain = make_llm(ckpt_a, max_seq_len=256, max_batch_size=5)
    ref = plain.generate(prompt_token_ids=prompts[:5], sampling_params=params)
    runs = []
    for _ in range(2):
        llm = _tree_llm(make_llm, ckpt_a, ckpt_a, 5)
        runs.append(llm.generate(prompt_token_ids=prompts[:5], sampling_params=params))
        assert llm.engine.runner.stats.accepted_tokens > 0
    first, second = runs
    assert _tokens(first) == _tokens(second)
    assert [_tokens(first)[i] for i in (0, 3)] == [plain_outputs[0], plain_outputs[3]]
    got, want = first[3].outputs[0].logprobs, ref[3].outputs[0].logprobs
    assert len(got) == len(want) == MAX_NEW
    for a, b in zip(got, want):
        assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_round_emits_the_whole_path_and_a_stop_inside_it_ends_there(make_llm, ckpt_a, prompts, plain_outputs):
    llm = _tree_llm(make_llm, ckpt_a, ckpt_a, 1)
    engine = llm.engine
    req = engine.add_request(prompts[0], GREEDY)
    engine.step()  # prefill: the first token
    mine = [out for r, out in engine.step() if r is req]  # one tree round
    assert [o.token_id for o in mine] == plain_outputs[0][1:DEPTH + 2]
    while engine.has_unfinished():
        engine.step()
    ref = plain_outputs[0]
    stop_at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[ref[stop_at]])
    out = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params)[0].outputs[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == plain_outputs[1][:7] and out.finish_reason == "length"


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_length_guards_near_max_seq_len(make_llm, ckpt_a, prompts, backend):
    # the block needs 22 positions: near max_seq_len the depth shrinks until it fits, per row
    ps = [prompts[0][:25] + [5] * max(0, 25 - len(prompts[0])), prompts[1][:9]]
    params = [SamplingParams(temperature=0, max_tokens=48 - len(p), ignore_eos=True) for p in ps]
    plain = make_llm(ckpt_a, max_seq_len=48, kv_cache_backend=backend, max_batch_size=2)
    ref = _tokens(plain.generate(prompt_token_ids=ps, sampling_params=params))
    llm = make_llm(ckpt_a, max_seq_len=48, kv_cache_backend=backend, max_batch_size=2, block_size=4,
                   use_speculative_decoding=True, draft_model=str(ckpt_a), spec_tree=TREE)
    assert _tokens(llm.generate(prompt_token_ids=ps, sampling_params=params)) == ref
    stats = llm.engine.runner.stats
    assert _full_depth_every_round(stats) and len(set(stats.drafted_per_position)) > 1  # shallower rounds too


def test_the_engine_speculates_over_the_tree_and_reports_tree_metrics(make_llm, ckpt_a, prompts):
    from infer.server.metrics import spec_metrics
    llm = _tree_llm(make_llm, ckpt_a, None, 2, method="ngram", tree="2,2")
    runner = llm.engine.runner
    assert str(runner.speculation.tree) == "2,2"
    assert llm.engine.config.spec_length == 2
    out = llm.generate(prompt_token_ids=[prompts[0] * 3], sampling_params=GREEDY)[0].outputs[0]
    stats = runner.stats
    assert out.mean_accepted_length is not None and stats.drafts > 0
    families = {f.name: {tuple(s.labels.items()): s.value for s in f.samples} for f in spec_metrics(stats)}
    lengths = families["infer_spec_decode_accepted_length"]
    assert sum(lengths.values()) == stats.drafts
    assert sum(int(k[0][1]) * v for k, v in lengths.items()) == stats.accepted_tokens
    assert families["infer_spec_decode_drafted_per_position"][(("position", "0"),)] == stats.drafts


@pytest.mark.parametrize("kwargs, words", [
    (dict(spec_tree="3,2", use_speculative_decoding=False), "use_speculative_decoding"),
    (dict(use_speculative_decoding=True, spec_tree="3,,2"), "spec_tree"),
    (dict(use_speculative_decoding=True, spec_tree="0,2"), "spec_tree"),
    (dict(use_speculative_decoding=True, spec_tree=",".join(["1"] * 33)), "32 levels"),
    (dict(use_speculative_decoding=True, spec_tree="8,8,8"), "128 nodes"),
    (dict(use_speculative_decoding=True, spec_tree="3,2", spec_length=4), "depth 2"),
    (dict(use_speculative_decoding=True, spec_tree="3,2", spec_length=5), "depth 2"),  # (5: no default to hide behind)
    (dict(use_speculative_decoding=True, spec_tree="3,2", spec_policy="adaptive"), "fixed"),
])
def test_config_validation(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


def test_config_and_flag():
    import argparse

    from infer.engine.args import add_engine_args, engine_config_from_args
    config = EngineConfig(use_speculative_decoding=True, spec_tree="3, 2,1,1", spec_length=4)
    assert (config.spec_tree, config.spec_length) == ("3,2,1,1", 4)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-decoding", "--spec-tree", "2,2,1"])
    assert (engine_config_from_args(args).spec_tree, engine_config_from_args(args).spec_length) == ("2,2,1", 3)
    assert engine_config_from_args(parser.parse_args(["--speculative-decoding"])).spec_length == 5  # a chain
