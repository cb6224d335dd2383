"""EAGLE / EAGLE-3 heads end to end (CPU): greedy parity with plain decoding under batching,
prefix caching, chunked prefill and preemption (the suite's `make_llm` checks that nothing
leaks); losslessness of sampling on a tiny vocabulary (total variation against the exact
joint distribution, with a negative control); a mismatched head refused at load; the head's
rounds through the fused kernel bundle drafting what EAGER drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.eagle_heads import counting_fused_kernels, write_head
from helpers.joint import empirical_joint, exact_joint, force_first_child, seeded, tiny_model, total_variation
from helpers.spec_e2e import DEPTH, ENGINE_CONFIGS, check_mixed_rows, run
from infer import LLM, SamplingParams

VOCAB, PROMPT, N, TV_LIMIT = 4, [2, 3, 2], 6000, 0.07  # as tests/integration/test_speculative_sampling.py
TREE = "2,2,1,1"  # depth DEPTH, 14 nodes


def _llm(make_llm, ckpt: Path, method: str, head: Path, **options) -> LLM:
    return make_llm(ckpt, max_seq_len=256, use_speculative_decoding=True, speculative_method=method,
                    draft_model=str(head), **{"spec_length": DEPTH, **options})


@pytest.mark.parametrize("config", ["paged-prefix-small-chunks", "paged-preempt"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_greedy_parity(make_llm, ckpt_a, heads, prompts, plain_outputs, method, config) -> None:
    llm = _llm(make_llm, ckpt_a, method, heads[method], max_batch_size=8, **ENGINE_CONFIGS[config])
    batched = [o.outputs[0].token_ids for o in run(llm, prompts, batch=8)]
    assert batched == plain_outputs
    if config == "paged-preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    else:  # batch 1, each prompt twice: the second run starts after a cached prefix
        again = [o.outputs[0].token_ids for o in run(llm, prompts[:3] + prompts[:3], batch=1)]
        assert again == plain_outputs[:3] * 2
        assert llm.engine.runner.cache_pool.prefix_hit_rate > 0
    stats = llm.engine.runner.stats
    assert stats is not None and stats.draft_tokens > 0


def test_mismatched_head_refused(make_llm, ckpt_a, tmp_path) -> None:
    head = write_head(tmp_path / "wide", ckpt_a, "eagle3", hidden_size=32, aux_layers=[0, 1, 1])
    with pytest.raises(ValueError, match="does not fit the target"):
        _llm(make_llm, ckpt_a, "eagle3", head)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_tree_greedy_parity(make_llm, ckpt_a, heads, prompts, plain_outputs, method) -> None:
    """Static trees: batch 4 then batch 1 over cached prefixes give plain decoding's tokens;
    every slot and block of both pools given back."""
    llm = _llm(make_llm, ckpt_a, method, heads[method], max_batch_size=4, spec_tree=TREE,
               **ENGINE_CONFIGS["paged-prefix-small-chunks"])
    assert [o.outputs[0].token_ids for o in run(llm, prompts[:4], batch=4)] == plain_outputs[:4]
    again = [o.outputs[0].token_ids for o in run(llm, prompts[:2] + prompts[:2], batch=1)]
    assert again == plain_outputs[:2] * 2
    assert llm.engine.runner.cache_pool.prefix_hit_rate > 0
    stats = llm.engine.runner.stats
    assert stats is not None and stats.draft_tokens > DEPTH * stats.drafts  # (more nodes than a chain holds)
    assert llm.engine.leak_report() == []


def test_tree_preemption_and_mixed_sampling(make_llm, ckpt_a, heads, prompts, plain_outputs) -> None:
    """A tree batch short of blocks (preemption drops the head's state, refilled on return),
    greedy rows beside sampled ones with penalties (the children's penalty contexts): the
    greedy rows keep plain decoding's tokens."""
    llm = _llm(make_llm, ckpt_a, "eagle3", heads["eagle3"], max_batch_size=8, spec_tree=TREE,
               **ENGINE_CONFIGS["paged-preempt"])
    check_mixed_rows(llm, prompts, plain_outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.leak_report() == []


def _drafts(make_llm, ckpt_a, head: Path, prompts, path: tuple[int, ...],
            **options) -> dict[tuple[str, int], tuple[int, ...]]:
    """The present tokens on the nodes `path` that each greedy round drafted, by (request,
    position), over a batch of 4."""
    llm = _llm(make_llm, ckpt_a, "eagle3", head, max_batch_size=4, **ENGINE_CONFIGS["contiguous"], **options)
    proposer = llm.engine.runner.speculation.proposer
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    propose = proposer.propose

    def recording(requests, shape, depths):
        drafts = propose(requests, shape, depths)
        for r, d in zip(requests, drafts, strict=True):
            seen[(r.request_id, r.num_computed_tokens)] = tuple(d.token_ids[i] for i in path if i < len(d.valid) and d.valid[i])
        return drafts

    proposer.propose = recording
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(temperature=0, max_tokens=9))
    return seen


def test_tree_first_children_are_the_chain(make_llm, ckpt_a, heads, prompts) -> None:
    """A greedy tree's first children are the head's argmax, each fed over the nodes above it
    with the tree mask and rotary positions: the first-child path of "2,2,1" drafts what a
    greedy chain of 3 drafts from the same context."""
    chain = _drafts(make_llm, ckpt_a, heads["eagle3"], prompts, (0, 1, 2), spec_length=3)
    # node 0, its first child 2, that one's child 6
    tree = _drafts(make_llm, ckpt_a, heads["eagle3"], prompts, (0, 2, 6), spec_tree="2,2,1", spec_length=3)
    shared = set(chain) & set(tree)
    assert len(shared) >= 4  # (every request's first round at least)
    assert all(tree[key] == chain[key] for key in shared)
    assert any(len(chain[key]) == 3 for key in shared)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = tiny_model(tmp_path_factory.mktemp("t"), VOCAB, seed=1)
    # 3 of the 4 tokens in the draft vocabulary: q is 0 at the fourth, which only the target proposes
    return target, write_head(tmp_path_factory.mktemp("h"), target, "eagle3", draft_vocab=3, aux_layers=[0, 1, 1],
                              std=0.5)


def _tv(make_llm, tiny, n: int = N, **options) -> tuple[float, LLM]:
    target, head = tiny
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, PROMPT, params, VOCAB)
    llm = make_llm(target, max_seq_len=16, use_speculative_decoding=True, speculative_method="eagle3",
                   draft_model=str(head), **{"max_batch_size": 64, "spec_length": 3, **options})
    outputs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=seeded(params, n))
    return total_variation(empirical_joint(outputs), exact), llm


def test_sampling_lossless(make_llm, tiny) -> None:
    tv, llm = _tv(make_llm, tiny)
    stats = llm.engine.runner.stats
    assert tv < TV_LIMIT
    assert stats is not None and 0 < stats.accepted_tokens < stats.draft_tokens  # drafts accepted and rejected


def test_negative_control_accept_all_fails(make_llm, tiny, monkeypatch) -> None:
    import infer.speculative.verifier as verifier
    real_verify = verifier.verify_tensors

    def accept_all(draft_tokens, counts, draft_probs, target_probs, accept_u, sample_u):
        return real_verify(draft_tokens, counts, draft_probs, target_probs, torch.zeros_like(accept_u), sample_u)

    monkeypatch.setattr(verifier, "verify_tensors", accept_all)
    tv, _ = _tv(make_llm, tiny)
    assert tv > TV_LIMIT


# the first three tokens: the prefill's, then one round of the depth-2 tree (4 tokens asked: the
# length guard leaves it both levels)
TREE_TV = dict(spec_tree="2,2", spec_length=2, max_batch_size=256)


def test_tree_sampling_lossless(make_llm, tiny) -> None:
    """Siblings drawn without replacement from the head's q (3 draft-vocabulary tokens of 4),
    each reporting its renormalised q: the tree verifier keeps the target's distribution."""
    tv, llm = _tv(make_llm, tiny, **TREE_TV)
    stats = llm.engine.runner.stats
    assert tv < TV_LIMIT
    assert stats is not None and 0 < stats.accepted_tokens < sum(stats.drafted_per_position)


def test_tree_negative_control_first_child_accepted_fails(make_llm, tiny, monkeypatch) -> None:
    # uniforms of 0 pass every acceptance test: the first child is always accepted (far off the
    # target: a quarter of the requests show it)
    force_first_child(monkeypatch)
    tv, _ = _tv(make_llm, tiny, n=N // 4, **TREE_TV)
    assert tv > TV_LIMIT


@pytest.mark.parametrize("variant", ["chains", "log-probabilities", "chain-shaped tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_round_matches_general_path(make_llm, ckpt_a, heads, prompts, temperature, variant) -> None:
    """The fused round (`head_round`, what CUDA graphs capture; its tokens left on the
    device) drafts what the step-by-step general path drafts: same tokens, acceptance and
    log-probabilities, batched, seeded sampling included; also where the verification reads
    the tokens on the host (a row asking for log-probabilities, a static tree shaped as a chain)."""
    params = [SamplingParams(temperature=temperature, max_tokens=9, ignore_eos=True, seed=s,
                             logprobs=1 if variant == "log-probabilities" and s == 3 else None) for s in range(4)]
    options = {"spec_tree": ",".join(["1"] * DEPTH)} if variant == "chain-shaped tree" else {}
    results = []
    for fused in (False, True):
        llm = _llm(make_llm, ckpt_a, "eagle3", heads["eagle3"], max_batch_size=4, **ENGINE_CONFIGS["contiguous"],
                   **options)
        proposer = llm.engine.runner.speculation.proposer
        proposer.fused = fused
        outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=params)
        stats = llm.engine.runner.stats
        logprobs = [[(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs or []] for o in outs]
        results.append(([o.outputs[0].token_ids for o in outs], stats.draft_tokens, stats.accepted_tokens, logprobs))
        assert (proposer.fused_rounds > 0) == fused
    assert results[0] == results[1]
    if variant == "log-probabilities":
        assert results[0][3][3] and not results[0][3][0]


def test_rounds_through_the_fused_bundle_draft_as_eager(make_llm, ckpt_a, heads, prompts, monkeypatch) -> None:
    """The head's bundle reaches its rounds (runner -> `step_kernels` of the head -> proposer ->
    `head_round`): the fused bundle with EAGER's functions as its fallbacks (the CPU's
    routes) drafts EAGER's tokens, greedy and seeded sampled rows in one batch."""
    import infer.engine.runner as runner_module
    from infer.models.eagle import EagleHead
    params = [SamplingParams(temperature=0.0 if s % 2 == 0 else 1.0, max_tokens=9, ignore_eos=True, seed=s)
              for s in range(4)]
    fused, calls = counting_fused_kernels()
    results = []
    for bundle in ("eager", "fused"):
        if bundle == "fused":
            real = runner_module.step_kernels
            monkeypatch.setattr(runner_module, "step_kernels", lambda config, device, model=None: (
                fused if isinstance(model, EagleHead) else real(config, device, model)))
        llm = _llm(make_llm, ckpt_a, "eagle3", heads["eagle3"], max_batch_size=4, **ENGINE_CONFIGS["contiguous"])
        proposer = llm.engine.runner.speculation.proposer
        assert proposer.round_fn.kernels is proposer.kernels and proposer.kernels.name == bundle
        drafted: list[list[int]] = []
        propose = proposer.propose

        def recording(*args, propose=propose, drafted=drafted):
            drafts = propose(*args)
            drafted.extend(list(d.token_ids) for d in drafts)
            return drafts

        proposer.propose = recording
        outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=params)
        assert proposer.fused_rounds > 0
        results.append(([o.outputs[0].token_ids for o in outs], drafted, llm.engine.runner.stats.accepted_tokens))
    assert calls  # the bundle's own entries ran
    assert results[0] == results[1]
    assert sum(map(len, results[0][1])) > 0


@pytest.mark.parametrize("config", ["paged-prefix-small-chunks", "paged-preempt", "contiguous"])
def test_rounds_drafted_ahead_draft_as_rounds_after_the_verdict(make_llm, tiny, config) -> None:
    """Greedy chain rounds drafted ahead (under the last round's verification, from its
    verdict on the device: `EagleProposer.verifying`) draft what rounds drafted once the host
    has the verdict draft: the same tokens, drafts and acceptance per position, batched, over
    cached prefixes and under preemption (requests leaving and coming back between rounds),
    rounds accepting every depth (a 4-token vocabulary); every slot and block given back
    (`make_llm`)."""
    target, head = tiny
    prompts = [[(3 * i + j * j) % VOCAB for j in range(3 + i % 4)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = make_llm(target, max_seq_len=64, max_batch_size=8, **ENGINE_CONFIGS[config])
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    results = []
    for ahead in (False, True):
        llm = make_llm(target, max_seq_len=64, use_speculative_decoding=True, speculative_method="eagle3",
                       draft_model=str(head), max_batch_size=8, spec_length=3, **ENGINE_CONFIGS[config])
        proposer = llm.engine.runner.speculation.proposer
        proposer.ahead = ahead
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        stats = llm.engine.runner.stats
        results.append(([o.outputs[0].token_ids for o in outs], stats.draft_tokens, stats.accepted_per_position))
        assert (proposer.ahead_rounds > 0) == ahead
        if config == "paged-preempt":
            assert llm.engine.scheduler.num_preemptions > 0
    assert results[0] == results[1]
    assert results[0][0] == expected
    assert results[0][2][1] > 0  # (rounds accepting two drafts and more: drafting from the middle of a feed)


def test_rounds_drafted_ahead_beside_plain_rows_and_an_abort(make_llm, tiny) -> None:
    """Rows with `speculation=False` beside drafting ones (the rounds drafted ahead are the
    drafting rows'), and a request aborted while its next round is drafted ahead: the
    others keep plain decoding's tokens, and every slot and block comes back."""
    target, head = tiny
    prompts = [[(5 * i + j) % VOCAB for j in range(4 + i % 3)] for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, speculation=False)
    params = [plain if i % 3 == 1 else greedy for i in range(len(prompts))]
    reference = make_llm(target, max_seq_len=64, max_batch_size=8)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    llm = make_llm(target, max_seq_len=64, max_batch_size=8, use_speculative_decoding=True,
                   speculative_method="eagle3", draft_model=str(head), spec_length=3)
    engine = llm.engine
    proposer = engine.runner.speculation.proposer
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    doomed = requests[2]
    while len(doomed.output_token_ids) < 8:
        engine.step()
    assert proposer.states[doomed.request_id].ahead is not None  # (its next round is drafted ahead)
    engine.abort(doomed.request_id)
    while engine.has_unfinished():
        engine.step()
    assert proposer.ahead_rounds > 0
    for i, r in enumerate(requests):
        if r is not doomed:
            assert list(r.output_token_ids) == expected[i]
    assert engine.leak_report() == []


def test_greedy_rows_draft_ahead_beside_sampled_rows(make_llm, tiny) -> None:
    """Greedy rows beside seeded sampled rows: the greedy rows' next rounds are drafted ahead,
    the sampled rows draft after the verdict, both kinds in one verification (drafts of two
    rounds on the device); every row's tokens as with nothing drafted ahead."""
    target, head = tiny
    prompts = [[(7 * i + j) % VOCAB for j in range(3 + i % 4)] for i in range(8)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=32, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    results = []
    for ahead in (False, True):
        llm = make_llm(target, max_seq_len=64, max_batch_size=8, use_speculative_decoding=True,
                       speculative_method="eagle3", draft_model=str(head), spec_length=3)
        proposer = llm.engine.runner.speculation.proposer
        proposer.ahead = ahead
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        results.append(([o.outputs[0].token_ids for o in outs], llm.engine.runner.stats.accepted_per_position))
        assert (proposer.ahead_rounds > 0) == ahead
    assert results[0] == results[1]
