"""Per-request speculation (`SamplingParams.speculation`) end to end (CPU, tiny checkpoints).

Rows with speculation off, with K=2 and with the engine's K (4) share every batch: each
keeps its greedy output (plain decoding's) and its seeded sample (the same request alone,
and a rerun); a row drafts at most its own K and the scheduler reserves its own round's
positions (1 for a plain row); only speculating rows count in the statistics; the
proposer never holds state for a plain row. Chains with a draft model, n-gram tables and
EAGLE / EAGLE-3 heads; static trees cut to depth K; dynamic trees; the adaptive policy. A
K above the engine's, or any K without speculation, is refused when the request is added.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers.spec_e2e import MAX_NEW
from infer import LLM, SamplingParams
from infer.engine.request import Request

K = 4  # the engine's spec_length
SPECS = (False, 2, None, False, 2, None)  # a row's `speculation`, one per prompt
SEEDS = (11, 22, 33, 44, 55, 66)


def _params(spec: bool | int | None, seed: int | None = None) -> SamplingParams:
    """Greedy without a seed, else sampled at temperature 1 with it."""
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=MAX_NEW, ignore_eos=True,
                          speculation=spec)


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.outputs[0].token_ids for o in outs]


class Planned:
    """Records, per request, the deepest round planned for it and the most positions the
    scheduler reserved for its step (wraps the engine's `Speculation.depths`)."""

    def __init__(self, llm: LLM) -> None:
        spec = llm.engine.runner.speculation
        assert spec is not None
        self.depth: dict[str, int] = defaultdict(int)
        self.room: dict[str, int] = defaultdict(int)
        real = spec.depths

        def depths(requests: list[Request], room: list[int] | None = None) -> list[int]:
            ks = real(requests, room)
            for i, (r, k) in enumerate(zip(requests, ks, strict=True)):
                self.depth[r.request_id] = max(self.depth[r.request_id], k)
                self.room[r.request_id] = max(self.room[r.request_id], room[i] if room is not None else 0)
            return ks

        spec.depths = depths  # type: ignore[method-assign]


def _engine(make_llm: Any, ckpt: Path, method: str, draft: Path | None, **extra: Any) -> LLM:
    kw: dict[str, Any] = dict(max_seq_len=256, max_batch_size=len(SPECS), use_speculative_decoding=True,
                              speculative_method=method, **extra)
    if "spec_tree" not in extra:
        kw["spec_length"] = K
    if draft is not None:
        kw["draft_model"] = str(draft)
    return make_llm(ckpt, **kw)


def _draft(method: str, ckpt_a: Path, heads: dict[str, Path]) -> Path | None:
    return {"draft_model": ckpt_a, "eagle": heads["eagle"], "eagle3": heads["eagle3"]}.get(method)


def _check_plans(llm: LLM, planned: Planned, spec_length: int, width: dict[int, int]) -> None:
    """Rows drafted at most their own K (the engine's reaching it), and the scheduler reserved
    `width[k]` positions for a row of K = k at most (1: a plain row)."""
    reqs = sorted(planned.depth, key=lambda rid: int(rid.split("-")[1]))
    assert len(reqs) % len(SPECS) == 0
    for i, rid in enumerate(reqs):
        spec = SPECS[i % len(SPECS)]
        own = spec_length if spec is None else int(spec)
        assert planned.depth[rid] == own, (rid, spec, planned.depth[rid])
        assert planned.room[rid] == width[own], (rid, spec, planned.room[rid])


CHAIN_WIDTHS = {k: 1 + k for k in range(K + 1)}


@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle3", "eagle"])
def test_rows_off_at_two_and_at_the_engines_k_share_a_batch(make_llm, ckpt_a, heads, prompts, plain_outputs,
                                                            method) -> None:
    llm = _engine(make_llm, ckpt_a, method, _draft(method, ckpt_a, heads))
    planned = Planned(llm)
    rows = prompts[:len(SPECS)]
    assert _tokens(llm, rows, [_params(s) for s in SPECS]) == plain_outputs[:len(SPECS)]
    _check_plans(llm, planned, K, CHAIN_WIDTHS)
    sampled = [_params(s, seed) for s, seed in zip(SPECS, SEEDS, strict=True)]
    batched = _tokens(llm, rows, sampled)
    assert _tokens(llm, rows, sampled) == batched  # a rerun
    for prompt, params, tokens in zip(rows, sampled, batched, strict=True):  # each alone
        assert _tokens(llm, [prompt], [params]) == [tokens], params.speculation
    assert llm.engine.runner.stats.draft_tokens > 0
    assert llm.engine.leak_report() == []


def test_only_speculating_rows_count_and_plain_rows_hold_no_draft_state(make_llm, ckpt_a, prompts) -> None:
    """A plain row beside drafting ones: no round counted for it, no acceptance reported, no
    draft slot ever taken; the engine's counters are the speculating rows' own."""
    llm = _engine(make_llm, ckpt_a, "draft_model", ckpt_a)
    engine, draft = llm.engine, llm.engine.runner.speculation.draft
    plain, spec = (engine.add_request(p, _params(s)) for p, s in zip(prompts[:2], (False, None), strict=True))
    while engine.has_unfinished():
        engine.step()
        assert plain.slot is None or plain.slot not in draft.draft_slots
    stats = engine.runner.stats
    assert plain.spec_rounds == 0 and plain.mean_acceptance_rate() is None
    assert spec.spec_rounds == stats.rounds > 0 and spec.spec_tokens_emitted == stats.emitted_tokens
    assert len(plain.output_token_ids) == len(spec.output_token_ids) == MAX_NEW
    assert engine.leak_report() == []


TREES = {  # config, the positions a round of depth k reserves
    "static": (dict(spec_tree="2,2,1"), {0: 1, 1: 3, 2: 7, 3: 11}),
    "dynamic": (dict(spec_tree="dynamic:6:2", spec_length=3), {0: 1, 1: 7, 2: 7, 3: 7}),
}


@pytest.mark.parametrize("method, tree", [("draft_model", "static"), ("ngram", "static"), ("eagle3", "static"),
                                          ("draft_model", "dynamic")])
def test_a_tree_is_cut_to_a_rows_depth(make_llm, ckpt_a, heads, prompts, plain_outputs, method, tree) -> None:
    config, widths = TREES[tree]
    llm = _engine(make_llm, ckpt_a, method, _draft(method, ckpt_a, heads), **config)
    planned = Planned(llm)
    rows = prompts[:len(SPECS)]
    assert _tokens(llm, rows, [_params(s) for s in SPECS]) == plain_outputs[:len(SPECS)]
    _check_plans(llm, planned, 3, widths)
    sampled = [_params(s, seed) for s, seed in zip(SPECS, SEEDS, strict=True)]
    batched = _tokens(llm, rows, sampled)
    assert _tokens(llm, rows, sampled) == batched
    assert _tokens(llm, rows[:1], sampled[:1]) == batched[:1]  # the plain row alone
    assert llm.engine.leak_report() == []


def test_the_adaptive_policy_and_the_batch_limit_still_cap_a_rows_k(make_llm, ckpt_a, random_draft, prompts,
                                                                    plain_outputs) -> None:
    """Adaptive K over a draft that is always rejected (it starts at the engine's K, then
    falls to plain steps and probes): a row asking for 2 drafts at most 2, a plain row never
    reaches the policy; above spec_disable_batch_size no row drafts."""
    llm = _engine(make_llm, ckpt_a, "draft_model", random_draft, spec_policy="adaptive", spec_cost_coefficient=0.05)
    planned = Planned(llm)
    policy = llm.engine.runner.speculation.policy
    seen: set[str] = set()
    choose = policy.choose
    policy.choose = lambda requests, overhead=0.0: (seen.update(r.request_id for r in requests),  # type: ignore
                                                    choose(requests, overhead))[1]
    rows = prompts[:len(SPECS)]
    assert _tokens(llm, rows, [_params(s) for s in SPECS]) == plain_outputs[:len(SPECS)]
    ids = sorted(planned.depth, key=lambda rid: int(rid.split("-")[1]))
    assert [planned.depth[rid] for rid in ids] == [{False: 0, 2: 2, None: K}[s] for s in SPECS]
    assert [planned.room[rid] for rid in ids] == [{False: 1, 2: 3, None: K + 1}[s] for s in SPECS]
    assert seen == {rid for rid, s in zip(ids, SPECS, strict=True) if s is not False}
    limited = _engine(make_llm, ckpt_a, "draft_model", ckpt_a, spec_disable_batch_size=1)
    assert _tokens(limited, prompts[:2], [_params(2), _params(None)]) == plain_outputs[:2]
    assert limited.engine.runner.stats.rounds == 0


def test_a_plain_row_keeps_its_prefix_hit_beside_an_eagle_head(make_llm, ckpt_a, heads, prompts,
                                                                plain_outputs) -> None:
    """With prefix caching an EAGLE head cuts a request's hit to the blocks it restores; a
    plain row needs none of them: it takes the target's whole hit and the head keeps no
    state for it. A drafting row after it takes only what the head holds."""
    llm = _engine(make_llm, ckpt_a, "eagle3", heads["eagle3"], block_size=2)
    engine, head = llm.engine, llm.engine.runner.speculation.proposer
    prompt = prompts[0]
    hit = (len(prompt) - 1) // 2 * 2  # full blocks, the last prompt token computed
    assert _tokens(llm, [prompt], [_params(False)]) == plain_outputs[:1]
    for spec, expected in ((False, hit), (None, 0)):  # (the head never cached the plain rows' blocks)
        request = engine.add_request(prompt, _params(spec))
        engine.scheduler.admit()
        assert request.num_computed_tokens == expected, spec
        while not request.is_finished:
            engine.step()
            assert spec is None or request.request_id not in head.states
        assert request.output_token_ids == plain_outputs[0]
    assert engine.leak_report() == []


def test_a_k_the_engine_does_not_draft_is_refused_when_added(make_llm, ckpt_a, prompts, plain_outputs) -> None:
    llm = _engine(make_llm, ckpt_a, "ngram", None)
    with pytest.raises(ValueError, match=f"spec_length {K}"):
        llm.engine.add_request(prompts[0], _params(K + 1))
    with pytest.raises(ValueError, match="speculation 5"):  # one bad row: nothing of the generate queued
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=[_params(2), _params(K + 1)])
    assert llm.engine.leak_report() == [] and not llm.engine.has_unfinished()
    plain = make_llm(ckpt_a, max_seq_len=256)
    with pytest.raises(ValueError, match="does not run"):
        plain.engine.add_request(prompts[0], _params(1))
    assert _tokens(plain, prompts[:1], [_params(False)]) == plain_outputs[:1]
    assert plain.engine.leak_report() == []
