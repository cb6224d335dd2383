"""Speculation length policy and SpecStats: pure functions, no model."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from infer.engine.request import Request
from infer.sampling import SamplingParams
from infer.spec.metrics import SpecStats
from infer.spec.policy import (AdaptivePolicy, CostModel, FixedPolicy, best_k, best_k_for_costs, expected_tokens,
                               guard_k, walltime_factor)


def _measure(costs, batch, k, seconds):
    """A cost counts from its second measurement on (the first may pay one-off costs)."""
    for _ in range(2):
        costs.observe(batch, k, seconds)


def _measure_switch(costs, batch, seconds):
    for _ in range(2):
        costs.observe_switch(batch, seconds)


@dataclass
class R:
    request_id: str
    num_computed_tokens: int = 10


def test_expected_tokens_matches_the_geometric_series():
    for a in (0.0, 0.3, 0.8):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5


def test_walltime_factor_is_the_papers_formula():
    a, k, c = 0.8, 4, 0.3
    assert walltime_factor(a, k, c) == pytest.approx((1 - a ** 5) / ((1 - a) * (k * c + 1)))
    assert walltime_factor(0.5, 0, 0.3) == pytest.approx(1.0)


def test_best_k_is_zero_when_nothing_pays_and_grows_with_acceptance():
    flat = [1.0] * 9
    assert best_k(0.05, 8, 0.5, flat) == 0
    ks = [best_k(a, 8, 0.1, flat) for a in (0.3, 0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0] > 0
    expensive_verify = [1.0] + [3.0] * 8  # large batches: verifying K+1 tokens costs 3 steps
    assert best_k(0.7, 8, 0.1, expensive_verify) == 0


def test_guard_k_respects_max_seq_len_and_tokens_left():
    assert guard_k(5, seq_len=10, max_seq_len=100, tokens_left=50) == 5
    assert guard_k(5, seq_len=96, max_seq_len=100, tokens_left=50) == 3  # positions 96..99
    assert guard_k(5, seq_len=99, max_seq_len=100, tokens_left=50) == 0
    assert guard_k(5, seq_len=10, max_seq_len=100, tokens_left=3) == 2


def test_fixed_policy_applies_the_guard():
    p = FixedPolicy(4)
    assert p.choose([R("a"), R("b")], [10, 98], 100, [20, 20]) == [4, 1]
    with pytest.raises(ValueError, match="spec_length"):
        FixedPolicy(0)


def test_adaptive_policy_switches_off_and_probes_back():
    costs = CostModel(5, draft_ratio={1: 0.3}, verify_ratio={1: [1.0] * 6})
    p = AdaptivePolicy(5, costs)
    r = R("x")
    assert p.choose([r], [10], 1000, [500]) == [0]  # first: measure a plain step
    _measure(costs, 1, 0, 0.010)
    assert p.choose([r], [10], 1000, [500])[0] > 0  # prior: speculate
    for _ in range(20):  # every draft rejected
        k = p.choose([r], [10], 1000, [500])[0]
        p.update("x", k, 0)
    ks = [p.choose([r], [10], 1000, [500])[0] for _ in range(200)]
    # off, with occasional probes, each with the K that would pay best at a = 0.9
    probe_k = best_k_for_costs(p.optimistic_a, costs.relative_costs(1), p.switch_margin)
    assert probe_k > 1
    assert ks.count(0) > 150 and set(ks) == {0, probe_k}
    recovered = None
    for step in range(300):  # drafts start being accepted: probes find out, K grows again
        k = p.choose([r], [10], 1000, [500])[0]
        p.update("x", k, k)
        if k >= 3:
            recovered = step
            break
    assert recovered is not None and recovered < 200
    est = p._lookup("x")
    seen = est.seen_accepted / est.seen_trials  # over the request's whole life: below its final estimate
    assert seen < p.acceptance("x")
    p.release("x")  # a new request starts from the prior moved towards what this one accepted
    weight = p.learned_weight * min(1.0, est.seen_trials / p.learned_full_trials)
    assert p.acceptance("x") == pytest.approx(p.prior_a + weight * (max(0.05, seen) - p.prior_a))


def test_spec_stats_counts():
    s = SpecStats()
    s.record(4, 2, 3)
    s.record(4, 4, 5)
    s.record(0, 0, 1)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.rounds, s.emitted_tokens) == (2, 8, 6, 3, 9)
    assert s.accepted_per_position == [2, 2, 1, 1]
    assert s.acceptance_rate == 0.75
    with pytest.raises(ValueError):
        s.record(2, 3, 4)


def test_measured_step_costs_override_calibration():
    costs = CostModel(4, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 5})
    assert costs.relative_costs(1) == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])
    _measure(costs, 1, 0, 0.001)
    for k in range(1, 5):  # host overhead: every speculative step costs 6-9 plain steps
        _measure(costs, 1, k, 0.001 * (5 + k))
    assert costs.relative_costs(1) == pytest.approx([1.0, 6.0, 7.0, 8.0, 9.0])
    p = AdaptivePolicy(4, costs, prior_a=0.9)
    assert p.choose([R("y")], [10], 1000, [500]) == [0]  # even 90 % acceptance does not pay
    for _ in range(5):  # the median of the last measurements follows a lasting change
        costs.observe(1, 4, 0.001)
    assert costs.relative_costs(1)[4] == pytest.approx(1.0)


def test_costs_are_kept_per_sampling_mode():
    # a sampled batch's rounds and plain steps cost more than a greedy one's (rejection
    # sampling, uniforms, sampling): each mode's r(K) comes from its own measurements, and
    # the policy prices a batch with its mode's (any sampled request makes it sampled)
    costs = CostModel(4, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 5})
    for batch in (1, 2):
        _measure(costs, batch, 0, 0.001)
        _measure(costs, batch, 4, 0.002)  # greedy: K=4 rounds at 2 plain steps
        for _ in range(2):
            costs.observe(batch, 0, 0.0013, sampled=True)
            costs.observe(batch, 4, 0.0065, sampled=True)  # sampled: 5 plain steps
    assert costs.relative_costs(1)[4] == pytest.approx(2.0)
    assert costs.relative_costs(1, sampled=True)[4] == pytest.approx(5.0)
    assert costs.has_round(1) and costs.has_round(1, sampled=True) and not costs.has_round(4)
    assert {k: v for k, v in costs.observed.items() if k[0] == 1} == {
        (1, 0, False): 0.001, (1, 4, False): 0.002, (1, 0, True): 0.0013, (1, 4, True): 0.0065}
    p = AdaptivePolicy(4, costs, prior_a=0.8, sampled_prior_a=0.8)
    greedy = Request("g", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100))
    sampled = Request("s", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=100))
    assert p.choose([greedy], [3], 1000, [100]) == [4]  # 3.36 tokens for 2 steps
    assert p.choose([sampled], [3], 1000, [100]) == [0]  # ... for 5: plain
    other = Request("h", [1, 2, 3], SamplingParams(temperature=0, max_tokens=100))
    assert p.choose([greedy, other], [3, 3], 1000, [100, 100]) == [4, 4]
    assert p.choose([greedy, sampled], [3, 3], 1000, [100, 100]) == [0, 0]  # a sampled batch
    assert CostModel(4).relative_costs(1, sampled=True) == CostModel(4).relative_costs(1)  # calibration: shared


def test_switch_margin_keeps_plain_decoding_near_break_even():
    from infer.spec.policy import best_k_for_costs
    costs = [1.0, 1.6, 2.2]
    a = 0.62  # K=1: 1.62 / 1.6 = 1.0125, a 1 % gain
    assert best_k_for_costs(a, costs) == 1
    assert best_k_for_costs(a, costs, margin=0.05) == 0
    assert best_k_for_costs(0.9, costs, margin=0.05) > 0  # a clear gain still speculates


def _rejecting(p, r, steps):
    for _ in range(steps):  # every draft rejected: the estimate falls to ~0
        k = p.choose([r], [10], 10_000, [5000])[0]
        p.update(r.request_id, k, 0)


def test_no_probes_when_no_k_could_pay():
    # host overhead: every speculative step costs 3+ plain steps, so even 90 % acceptance
    # loses; probing could only cost time
    costs = CostModel(4, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 5})
    _measure(costs, 1, 0, 0.001)
    for k in range(1, 5):
        _measure(costs, 1, k, 0.001 * (3 + k))
    p = AdaptivePolicy(4, costs)
    r = R("z")
    ks = [p.choose([r], [10], 10_000, [5000])[0] for _ in range(4000)]
    # a probe costs 3.2 plain steps: at a tenth of the 1 % budget, one per 3200 steps
    assert ks.count(0) >= 3998 and ks.count(1) <= 2 and set(ks) <= {0, 1}


def test_one_slow_step_does_not_lock_speculation_out():
    costs = CostModel(4, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 5})
    _measure(costs, 1, 0, 0.001)
    costs.observe(1, 1, 2.0)  # the very first speculative step hit a 2 s stall (a compile, say)
    assert costs.relative_costs(1)[1] == pytest.approx(1.1)  # not counted: calibration still rules
    p = AdaptivePolicy(4, costs, prior_a=0.9)
    r = R("s")
    assert p.choose([r], [10], 10_000, [5000])[0] > 0
    costs.observe(1, 1, 2.0)  # a second stall: now it counts, and nothing pays
    assert costs.relative_costs(1)[1] == pytest.approx(2000.0)
    ks = [p.choose([r], [10], 10_000, [5000])[0] for _ in range(p.max_probe_spacing * 2)]
    probes = [i for i, k in enumerate(ks) if k]  # K = 0 until a (rare) probe re-measures
    assert probes and probes[0] <= p.max_probe_spacing * 257 // 256 + 1
    p.update("s", 1, 1)
    _measure(costs, 1, 1, 0.0011)  # lower median of [2.0, 2.0, 0.0011, 0.0011]
    assert costs.relative_costs(1)[1] == pytest.approx(1.1)
    assert p.choose([r], [10], 10_000, [5000])[0] > 0  # speculating again


def test_probes_stay_within_their_time_budget():
    costs = CostModel(4, draft_ratio={1: 0.2}, verify_ratio={1: [1.0] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 1, 0.0013)  # r(1) = 1.3
    _measure_switch(costs, 1, 0.0005)  # the draft's catch-up: half a plain step
    assert costs.switch_cost(1) == pytest.approx(0.5)
    p = AdaptivePolicy(4, costs)
    r = R("w")
    _rejecting(p, r, 30)
    ks = [p.choose([r], [10], 10_000, [5000])[0] for _ in range(2000)]
    probes = [i for i, k in enumerate(ks) if k]
    # a probe drafts the K that pays best at a = 0.9 and costs its round plus the catch-up
    # (0.5), less the one token it surely emits: at a 1 % budget, one per (r(K) - 0.5) / 0.01
    probe_k = best_k_for_costs(p.optimistic_a, costs.relative_costs(1), p.switch_margin)
    assert set(ks) == {0, probe_k}
    spacing = math.ceil((costs.relative_costs(1)[probe_k] - 0.5) / 0.01)
    assert 2000 // spacing - 2 <= len(probes) <= 2000 // spacing + 1
    assert min(b - a for a, b in zip(probes, probes[1:])) >= spacing - 1
    cheap = AdaptivePolicy(4, costs, probe_budget=0.1)
    _rejecting(cheap, r, 30)
    assert sum(1 for _ in range(2000) if cheap.choose([r], [10], 10_000, [5000])[0]) > 2 * len(probes)


def test_unseen_k_costs_add_draft_steps_to_the_nearest_seen_one():
    costs = CostModel(4, draft_ratio={1: 0.1}, verify_ratio={1: [1.0, 1.0, 1.0, 1.2, 1.2]})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 1, 0.0022)  # calibrated 1.1, measured 2.2: the round's host overhead
    # paid once per round: K = 2..4 add draft steps (0.1) and wider verification (+0.2 from K = 3)
    assert costs.relative_costs(1) == pytest.approx([1.0, 2.2, 2.3, 2.6, 2.7])
    assert costs.switch_cost(1) == pytest.approx(0.2)  # nothing measured yet: two draft steps
    _measure(costs, 1, 4, 0.003)
    assert costs.relative_costs(1) == pytest.approx([1.0, 2.2, 2.3, 2.9, 3.0])  # K = 3 nearest to 4


def test_calibration_is_scaled_to_the_real_plain_step():
    # calibration times forwards alone (0.25 ms); a real plain step (1 ms) adds sampling, a
    # sync and output: a draft step and wider verification add only their forward time
    costs = CostModel(3, draft_ratio={1: 0.4}, verify_ratio={1: [1.0, 1.2, 1.2, 1.6]},
                      forward_seconds={1: 0.00025})
    assert costs.relative_costs(1) == pytest.approx([1.0, 1.6, 2.0, 2.8])  # no plain step measured yet
    _measure(costs, 1, 0, 0.001)
    assert costs.draft_step(1) == pytest.approx(0.1)
    assert costs.relative_costs(1) == pytest.approx([1.0, 1.15, 1.25, 1.45])
    _measure(costs, 1, 2, 0.0016)
    for _ in range(2):
        costs.observe_draft(1, 2, 0.0008)  # one length alone: its fixed part is unknown
    assert costs.draft_step(1) == pytest.approx(0.1)
    for _ in range(2):
        costs.observe_draft(1, 1, 0.0005)  # drafting really costs 0.3 ms a token (0.2 ms fixed)
    assert costs.draft_step(1) == pytest.approx(0.3)
    assert costs.relative_costs(1) == pytest.approx([1.0, 1.3, 1.6, 2.0])
    assert costs.switch_cost(1) == pytest.approx(0.6)


def test_first_probe_comes_early_while_only_calibration_is_known():
    # calibration says speculating costs 10 plain steps: probe once anyway to measure it
    costs = CostModel(4, draft_ratio={1: 3.0}, verify_ratio={1: [1.0] * 5})
    _measure(costs, 1, 0, 0.001)
    p = AdaptivePolicy(4, costs)
    r = R("e")
    ks = [p.choose([r], [10], 10_000, [5000])[0] for _ in range(5)]
    assert ks == [0, 0, 0, 1, 0] or ks == [0, 0, 0, 0, 1]
    _measure(costs, 1, 1, 0.0011)  # measured: cheap after all
    assert costs.relative_costs(1)[1] == pytest.approx(1.1)


def test_missing_proposals_back_off_without_touching_acceptance():
    # n-gram drafting on text without repeats: nothing to propose, so the request must stop
    # asking every step (a lookup costs host time); a miss is no rejection, and after a hit
    # (the text repeats again) it asks every step again
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 5, 0.0013)
    p = AdaptivePolicy(5, costs, plain_refresh=10_000)
    r = R("n")
    asked, watch = [], []
    for step in range(200):
        if p.choose([r], [10], 10_000, [5000])[0]:
            asked.append(step)
            watch.append(p.no_proposal("n"))
    assert all(watch)  # each miss was the request's to speculate (no probe): worth watching
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert len(asked) < 12 and gaps == sorted(gaps) and max(gaps) <= p.max_probe_interval + 1
    assert p.acceptance("n") == pytest.approx(p.prior_a)
    k = p.choose([r], [10], 10_000, [5000])[0]
    while not k:
        k = p.choose([r], [10], 10_000, [5000])[0]
    p.update("n", k, k)  # a hit, all accepted
    assert all(p.choose([r], [10], 10_000, [5000])[0] for _ in range(5))
    p.no_proposal("n")  # a single miss after the hit: a short wait again, not the long one
    assert [p.choose([r], [10], 10_000, [5000])[0] > 0 for _ in range(3)] == [False, True, True]
    assert FixedPolicy(3).no_proposal("n") is None


def test_a_probes_miss_is_not_worth_watching():
    # a request the estimate keeps plain probes now and then; a probe that finds no draft
    # would not make the request speculate once a draft appears, so watching it is no use
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 5, 0.0013)
    p = AdaptivePolicy(5, costs, plain_refresh=10_000, prior_a=0.05)  # speculating does not pay
    r = R("n")
    probes = 0
    for _ in range(3000):
        if p.choose([r], [10], 10_000, [5000])[0]:
            assert p._est["n"].probing
            assert p.no_proposal("n") is False
            probes += 1
    assert probes >= 1


def test_a_step_where_nobody_drafted_leaves_the_batch_plain_without_a_choice():
    # every request given k > 0 found nothing (n-gram misses): the next steps are plain
    # under a standing decision, as `choose` would decide them (the misses back off), so
    # the runner need not ask it; a batch in which someone drafted must ask again
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 2, 0, 0.001)
    _measure(costs, 1, 5, 0.0013)
    _measure(costs, 2, 5, 0.0013)
    p = AdaptivePolicy(5, costs, plain_refresh=10_000)
    a, b = R("a"), R("b")
    for _ in range(3):  # the second miss in a row waits 4 steps
        assert p.choose([a], [10], 10_000, [5000])[0] > 0
        p.no_proposal("a")
        assert p.quiet([a])
        waited = 1
        while p.quiet([a]):  # (bounded: a decision that never ends fails, not hangs)
            waited += 1
            assert waited < 64
    assert p.quiet_steps_left() == 0 and p.choose([a], [10], 10_000, [5000])[0] > 0
    p.update("a", 5, 5)  # a hit
    ks = p.choose([a, b], [10, 10], 10_000, [5000, 5000])
    assert all(ks)
    p.no_proposal("b")  # "a" drafts: a round runs, and the next step must choose
    assert not p.quiet([a, b])
    p.update("a", 5, 5)
    for _ in range(30):
        p.update("b", 5, 0)  # "b" drafts badly: plain, its next probe far off
    assert p.choose([a, b], [10, 10], 10_000, [5000, 5000]) == [5, 0]
    p.no_proposal("a")
    assert p.quiet([a, b]) and not p.quiet([a])  # the decision holds for its batch only


def test_spec_stats_minus_counts_what_happened_since():
    s = SpecStats()
    s.record(3, 1, 2)
    before = SpecStats(**{**s.__dict__, "accepted_per_position": list(s.accepted_per_position)})
    s.record(4, 4, 5)
    s.record(0, 0, 1)
    d = s.minus(before)
    assert (d.rounds, d.drafts, d.draft_tokens, d.accepted_tokens, d.emitted_tokens) == (2, 1, 4, 4, 6)
    assert d.accepted_per_position == [1, 1, 1, 1]
    assert d.acceptance_rate == 1.0 and d.mean_accepted_length == 3.0


def test_unseen_k_costs_stay_between_the_measured_ones():
    # verification much wider than it is cheap (a CPU): extrapolating down from K = 3 must
    # not price K = 1 below a plain step, nor K = 4 above the measured K = 5
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0, 1.1, 1.3, 1.6, 1.8, 2.0]},
                      forward_seconds={1: 0.003})  # slower than the real step: the share stays 1
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 3, 0.0012)
    _measure(costs, 1, 5, 0.0013)
    r = costs.relative_costs(1)
    assert r[3] == pytest.approx(1.2) and r[5] == pytest.approx(1.3)
    assert r[1] == pytest.approx(1.0) and r[2] == pytest.approx(1.0)  # 1.2 - 0.5 and 1.2 - 0.3, held at plain
    assert r[4] == pytest.approx(1.3)  # 1.2 + 0.2 (from K = 3), held at K = 5's


def test_costs_expire_and_restart_their_window():
    # two slow first measurements of K = 5 (first replays, say) must not price it out for
    # good: once expired it is predicted again from its neighbours, so it gets chosen and
    # re-measured; a plain step measured only at start-up expires likewise
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] * 6}, max_age=100)
    _measure(costs, 1, 0, 0.0025)  # start-up: slow
    _measure(costs, 1, 5, 0.0050)
    for _ in range(60):
        costs.observe(1, 4, 0.0006)
    assert costs.step_seconds(1, 5) == pytest.approx(0.005) and costs.has_plain(1)
    for _ in range(60):
        costs.observe(1, 4, 0.0006)
    assert costs.step_seconds(1, 5) is None and not costs.has_plain(1)  # 120 > max_age steps ago
    costs.observe(1, 0, 0.0004)
    # a new window; its first measurement counts alone (the one-off costs were the first
    # window's), and the start-up samples are gone
    assert costs.step_seconds(1, 0) == pytest.approx(0.0004)
    assert costs.relative_costs(1)[5] == pytest.approx(1.5)  # K = 4's 1.5 plus nothing per draft step


def test_a_renewed_costs_first_sample_alone_counts_only_up_to_its_expired_value():
    # K = 5 measured at 0.6 ms, then expired; one 5 ms outlier right after must not price it
    # out (nothing would re-measure a round not taken), a second slow sample shows a real rise
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] * 6}, max_age=10)
    _measure(costs, 1, 5, 0.0006)
    for _ in range(20):
        costs.observe(1, 0, 0.0004)
    assert costs.step_seconds(1, 5) is None  # expired
    costs.observe(1, 5, 0.005)
    assert costs.step_seconds(1, 5) == pytest.approx(0.0006)
    costs.observe(1, 5, 0.004)
    assert costs.step_seconds(1, 5) == pytest.approx(0.004)  # lower median of the new window
    for _ in range(20):  # a cheaper first sample after the next expiry is taken at once
        costs.observe(1, 0, 0.0004)
    costs.observe(1, 5, 0.0005)
    assert costs.step_seconds(1, 5) == pytest.approx(0.0005)


def test_expired_round_costs_stand_while_no_round_is_fresh():
    # a policy that stopped speculating re-measures plain steps only: its one expired round
    # cost must not fall back to a calibration of forwards alone (which prices it at 1.1)
    costs = CostModel(2, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 3}, max_age=10)
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 1, 0.0025)
    for _ in range(20):
        costs.observe(1, 0, 0.001)
    assert costs.step_seconds(1, 1) is None  # expired
    assert costs.relative_costs(1) == pytest.approx([1.0, 2.5, 2.6])


def test_a_bucket_never_measured_borrows_its_nearest_neighbours_round_costs():
    # calibration times forwards alone (a round: 1.1 plain steps) and misses the host
    # overhead that rounds really pay (3.9 plain steps at batch 8, measured): batch 2, where
    # no round ran, is priced from the nearest bucket with one, not from calibration (ties:
    # the larger bucket); its own measurement takes over; other sampling modes borrow nothing
    costs = CostModel(2, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 3})
    for b in (2, 8, 16, 32):
        _measure(costs, b, 0, 0.001)
    assert costs.relative_costs(2) == pytest.approx([1.0, 1.1, 1.2])  # no round anywhere: calibration
    _measure(costs, 8, 1, 0.0039)
    _measure(costs, 32, 1, 0.006)
    _measure_switch(costs, 8, 0.002)  # (other measurements are no rounds)
    assert costs.relative_costs(2) == pytest.approx([1.0, 3.9, 4.0])  # K = 2: one more draft step
    assert costs.relative_costs(16) == pytest.approx([1.0, 6.0, 6.1])  # 8 and 32 as near: 32
    assert not costs.has_round(2)  # borrowed, not measured: early probes still measure it
    for _ in range(2):
        costs.observe(2, 0, 0.001, sampled=True)
    assert costs.relative_costs(2, sampled=True) == pytest.approx([1.0, 1.1, 1.2])
    _measure(costs, 2, 1, 0.002)
    assert costs.relative_costs(2) == pytest.approx([1.0, 2.0, 2.1])


def test_plain_steps_and_rounds_are_priced_at_their_own_batch_size():
    # the bucket of 17-32 measured its plain steps with the batch full (2.1 ms at 32) and
    # batch 12's at 1.3 ms: a plain step at 20 is priced on the line between (1.62 ms), and a
    # round measured at 20 (3.24 ms) costs 2 plain steps, not the 1.54 of 3.24 / 2.1; the
    # episodes' baseline (`step_seconds(20, 0)`) is the same 1.62 ms
    costs = CostModel(1, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 2})
    _measure(costs, 32, 0, 0.0021)
    _measure(costs, 12, 0, 0.0013)
    assert costs.step_seconds(32, 0) == pytest.approx(0.0021)
    assert costs.step_seconds(20, 0) == pytest.approx(0.00162)
    assert costs.step_seconds(16, 0) == pytest.approx(0.0013 + 0.00004 * 4)  # above 12: toward 32's
    _measure(costs, 20, 1, 0.00324)
    assert costs.relative_costs(20) == pytest.approx([1.0, 2.0])
    assert costs.relative_costs(32) == pytest.approx([1.0, 2.0])  # a ratio: the same for the bucket
    # never extrapolated (flat where no bucket on the batch size's side is measured), and
    # kept between flat and proportional to the batch size
    lone = CostModel(1, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 2})
    _measure(lone, 32, 0, 0.002)
    _measure(lone, 33, 0, 0.006)  # above: 4 ms for one more request
    assert lone.step_seconds(20, 0) == pytest.approx(0.002)  # nothing measured below: flat
    _measure(lone, 16, 0, 0.0002)  # below: 0.2 ms, a line steeper than proportional
    assert lone.step_seconds(20, 0) == pytest.approx(0.002 * 20 / 32)  # at most proportional
    assert lone.step_seconds(15, 0) == pytest.approx(0.0002)  # (bucket 16, nothing below it: flat)
    top = CostModel(1, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 2})
    _measure(top, 12, 0, 0.0013)
    _measure(top, 6, 0, 0.001)
    assert top.step_seconds(9, 0) == pytest.approx(0.0013 - 0.00005 * 3)  # between 6 and 12
    assert top.step_seconds(15, 0) == pytest.approx(0.0013)  # above 12, nothing measured: flat


@pytest.mark.parametrize("field", ["prior_a", "sampled_prior_a"])
@pytest.mark.parametrize("value", [0.0, 1.0, 1.5])
def test_adaptive_policy_rejects_priors_outside_the_open_unit_interval(field, value):
    with pytest.raises(ValueError, match=field):
        AdaptivePolicy(4, CostModel(4), **{field: value})


@dataclass
class _Params:
    greedy: bool


@dataclass
class SR:
    """A request with sampling parameters (greedy or sampling at a temperature)."""

    request_id: str
    sampling_params: _Params
    num_computed_tokens: int = 10


def _demo_like_costs(base: float = 2.2) -> CostModel:
    """Round costs like the demo pair's on an H100: a K=5 round costs base + 1.5 plain steps
    (3.7), the draft's catch-up 0.9; only K = 5 pays, and only at an acceptance near 0.9."""
    costs = CostModel(5, draft_ratio={1: 0.6}, verify_ratio={1: [1.0] * 6})
    _measure(costs, 1, 0, 0.001)
    for k in range(1, 6):
        _measure(costs, 1, k, 0.001 * (base + 0.3 * k))
    _measure_switch(costs, 1, 0.0009)
    return costs


def _run(p: AdaptivePolicy, r, steps: int, accept) -> list[int]:
    """choose/update for `steps` steps; accept(k) -> tokens accepted of a k-token draft."""
    ks = []
    for _ in range(steps):
        k = p.choose([r], [10], 10_000, [256])[0]
        if k:
            p.update(r.request_id, k, accept(k))
        ks.append(k)
    return ks


def test_a_new_greedy_request_probes_early_and_speculates_when_drafts_are_accepted():
    # the prior (0.6) says no K pays, yet a good draft must be found out while most of the
    # request is ahead: its first probe (K = 5, the K that pays at a = 0.9) comes within a
    # few steps, probes that pay for themselves are refunded, and speculation starts
    p = AdaptivePolicy(5, _demo_like_costs())
    r = SR("g", _Params(greedy=True))
    ks = _run(p, r, 60, lambda k: k)
    first = next(i for i, k in enumerate(ks) if k)
    assert first <= 5 and ks[first] == 5
    assert sum(1 for k in ks[first:] if k == 5) >= 10  # speculating, not an odd probe
    # rounds a little dearer (K = 5: 4.0 plain steps): one accepted probe (a = 0.83) is not
    # enough, a second one is (a = 0.90); it comes at once, as the first paid for itself
    p = AdaptivePolicy(5, _demo_like_costs(base=2.5))
    ks = _run(p, SR("h", _Params(greedy=True)), 60, lambda k: k)
    probes = [i for i, k in enumerate(ks) if k]
    assert probes[1] - probes[0] <= 4
    assert sum(1 for k in ks if k == 5) >= 10
    # the same draft with every token rejected: one early probe, then plain decoding
    p = AdaptivePolicy(5, _demo_like_costs())
    ks = _run(p, SR("b", _Params(greedy=True)), 256, lambda k: 0)
    assert sum(1 for k in ks if k) == 1


def test_the_first_probe_comes_early_only_when_the_prior_expects_it_cheap_enough():
    # a K = 5 probe costs 4.6 plain steps; a greedy request of 256 tokens may spend 1 % of
    # them, 2.56, on it in advance, and expects 2.4 tokens from it (prior 0.6), a loss of
    # 2.2: it probes at once. A sampled one gets no advance (and would expect a loss of 3.2
    # at its prior, 0.3): it waits for its credit, past the end of this request
    def first_probe(sampled: bool, tokens: int = 256) -> int | None:
        p = AdaptivePolicy(5, _demo_like_costs())
        r = SR("f", _Params(greedy=not sampled))
        ks = [p.choose([r], [10], 10_000, [tokens])[0] for _ in range(256)]
        return next((i for i, k in enumerate(ks) if k), None)

    assert first_probe(sampled=False) <= 5
    assert first_probe(sampled=True) is None
    # a longer request's budget (5.12 plain steps) would cover the sampled loss: still none
    assert first_probe(sampled=False, tokens=512) <= 5
    assert first_probe(sampled=True, tokens=512) is None


def test_round_costs_gone_stale_are_measured_again_soon():
    # a round cost measured long ago (here slow: 6 plain steps for K = 1) must not keep the
    # policy from probing for good: once it has expired, probes come early until a fresh
    # measurement exists, and that first fresh measurement counts at once
    costs = CostModel(2, draft_ratio={1: 0.1}, verify_ratio={1: [1.0] * 3}, max_age=10)
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 1, 0.006)
    p = AdaptivePolicy(2, costs)
    r = R("t")
    assert not any(p.choose([r], [10], 10_000, [256])[0] for _ in range(50))  # nothing pays
    for _ in range(20):
        costs.observe(1, 0, 0.001)
    assert not costs.has_round(1)
    ks = [p.choose([r], [10], 10_000, [256])[0] for _ in range(p.recompute_every + 5)]
    assert any(ks)  # (the cost table is refreshed every `recompute_every` plain steps)
    costs.observe(1, 1, 0.0012)
    assert costs.has_round(1) and costs.relative_costs(1)[1] == pytest.approx(1.2)


def test_a_probe_is_priced_with_the_catch_up_its_gap_needs():
    # the draft catches up in chunks: one for a 128-token prompt, five for a 640-token one
    # (a code edit's). A chunk costs 0.9 plain steps: the long prompt's first probe would
    # lose 3.6 more and does not come early; the short one's does
    from infer.spec.draft_model import DraftModelProposer

    units = DraftModelProposer.catch_up_units.__get__(type("D", (), {"max_feed": 4})())
    assert [units(b) for b in (0, 3, 4, 131, 132, 640)] == [0, 0, 1, 1, 2, 5]

    def first_probe(context: int) -> int | None:
        p = AdaptivePolicy(5, _demo_like_costs(), catch_up_units=units)
        r = SR("c", _Params(greedy=True))
        ks = [p.choose([r], [context], 10_000, [256])[0] for _ in range(256)]
        return next((i for i, k in enumerate(ks) if k), None)

    assert first_probe(128) is not None and first_probe(128) <= 5
    assert first_probe(640) is None


def test_new_requests_start_from_what_finished_requests_of_their_kind_accepted():
    costs = CostModel(5)
    p = AdaptivePolicy(5, costs)
    greedy_prior, sampled_prior = p.prior(False), p.prior(True)
    p._lookup("idle")
    p.release("idle")  # no evidence: the priors stay
    assert (p.prior(False), p.prior(True)) == (greedy_prior, sampled_prior)
    for _ in range(30):
        p.update("g", 5, 5)  # a greedy request whose drafts all came true
    p.release("g")
    learned = greedy_prior + p.learned_weight * (0.95 - greedy_prior)  # (clamped at 0.95)
    assert p.prior(False) == pytest.approx(learned) and p.prior(True) == sampled_prior
    assert p.acceptance("next") == pytest.approx(learned)
    p._lookup("s", sampled=True)
    for _ in range(30):
        p.update("s", 5, 0)  # a sampled request whose drafts all failed
    p.release("s")
    assert p.prior(True) == pytest.approx(sampled_prior + p.learned_weight * (0.05 - sampled_prior))
    assert p.prior(False) == pytest.approx(learned)
    est = p._lookup("fresh", sampled=True)  # new estimates start there, at the prior's weight
    assert est.accepted / est.trials == pytest.approx(p.prior(True)) and est.trials == p.prior_weight
    fixed = AdaptivePolicy(5, costs, learned_weight=0.0)
    for _ in range(30):
        fixed.update("g", 5, 5)
    fixed.release("g")
    assert fixed.prior(False) == fixed.prior_a
    with pytest.raises(ValueError, match="learned_weight"):
        AdaptivePolicy(5, costs, learned_weight=1.5)
    with pytest.raises(ValueError, match="learned_full_trials"):
        AdaptivePolicy(5, costs, learned_full_trials=0)
    with pytest.raises(ValueError, match="table_margin"):
        AdaptivePolicy(5, costs, table_margin=-0.1)
    with pytest.raises(ValueError, match="switch_horizon"):
        AdaptivePolicy(5, costs, switch_horizon=0)
    with pytest.raises(ValueError, match="stay_margin"):
        AdaptivePolicy(5, costs, stay_margin=0.1)


def test_the_learned_prior_follows_what_drafts_accepted_not_restarted_estimates():
    # a sampled pair accepting ~1 token in 3: lucky probes restart a request's estimate at
    # the prior, so its final estimate says little; the prior must not feed on it
    p = AdaptivePolicy(5, CostModel(5))
    p._learned[True] = 0.7  # a prior that came out high
    est = p._lookup("s", sampled=True)
    for _ in range(10):
        p.update("s", 3, 1)  # 1 of 3 accepted, then a rejection: 1 in 2 trials
    p._restart(est)  # as after a lucky probe: the estimate is back at the prior
    assert est.accepted / est.trials == pytest.approx(0.7)
    p.release("s")
    # 10 accepted in 20 trials, full weight (>= 16 trials): 0.7 -> 0.7 + w * (0.5 - 0.7)
    assert p.prior(True) == pytest.approx(0.7 + p.learned_weight * (0.5 - 0.7))
    p._lookup("lucky", sampled=True)
    p.update("lucky", 2, 2)  # one probe, all accepted: 2 trials move the prior 2/16 of the weight
    p.release("lucky")
    before = 0.7 + p.learned_weight * (0.5 - 0.7)
    assert p.prior(True) == pytest.approx(before + p.learned_weight * 2 / 16 * (0.95 - before))


def test_speculation_starts_above_the_switch_margin_and_goes_on_above_the_stay_margin():
    # K=5 rounds cost 1.9 plain steps: at a = 0.49 they are expected to beat plain decoding by
    # ~2 %, below the 5 % it takes to start but above the 0 % it takes to go on
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
    for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0019), (5, 0.0019)):
        costs.observe(1, k, seconds)
    p = AdaptivePolicy(5, costs, plain_refresh=10_000, max_probe_interval=10_000)

    def at(rid: str, a: float) -> None:
        est = p._lookup(rid, sampled=True)  # (sampled: no early probe)
        est.accepted, est.trials = 10 * a, 10.0
        est.changed()
        p._quiet = None

    walltime = expected_tokens(0.49, 5) / 1.9
    assert 1.0 < walltime < 1.0 + p.switch_margin
    fresh, going = R("fresh"), R("going")
    at("fresh", 0.49)
    assert p.choose([fresh], [10], 10_000, [1000]) == [0]  # not enough to start
    at("going", 0.7)
    assert p.choose([going], [10], 10_000, [1000]) == [5]  # starts
    at("going", 0.49)
    assert p.choose([going], [10], 10_000, [1000]) == [5]  # enough to go on
    at("going", 0.4)
    assert p.choose([going], [10], 10_000, [1000]) == [0]  # below break-even: stops
    at("going", 0.49)
    assert p.choose([going], [10], 10_000, [1000]) == [0]  # and must clear the switch margin again


def test_quiet_steps_left_counts_the_steps_quiet_would_answer():
    # the runner runs `quiet_steps_left()` steps without asking `quiet` (a plain stretch),
    # then `count_quiet_steps`: the clock and the decision's end must be where asking every
    # step would have put them; `holds_quiet` (the reservation) agrees with `quiet` throughout
    def policy_after_a_plain_choice():
        costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
        for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0025), (5, 0.0025)):
            costs.observe(1, k, seconds)
        p = AdaptivePolicy(5, costs, plain_refresh=10_000)
        r = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000))
        p.update("a", 5, 0)  # a failed round: K = 0 pays best now
        assert p.choose([r], [3], 10_000, [1000]) == [0]
        return p, r

    asked, r = policy_after_a_plain_choice()
    steps = 0
    while asked.holds_quiet(r):
        assert asked.quiet([r])
        steps += 1
    assert not asked.quiet([r]) and steps >= 2
    counted, r2 = policy_after_a_plain_choice()
    assert counted.quiet_steps_left() == steps
    counted.count_quiet_steps(steps)
    assert counted._steps == asked._steps
    assert not counted.holds_quiet(r2) and not counted.quiet([r2])
    assert counted.quiet_steps_left() == 0


def test_a_decision_on_a_table_kept_past_its_recompute_period_still_holds_a_while():
    # a cost table older than `recompute_every` is kept while nothing new was measured; a
    # plain decision made on it must not end before the step it was made at (it did: it
    # held for no step, and every step asked `choose` in full) but after the refresh gap
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.9] * 5})
    for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0025), (5, 0.0025)):
        costs.observe(1, k, seconds)
    p = AdaptivePolicy(5, costs, plain_refresh=10_000, recompute_every=8, refresh_gap=4, probe_budget=1e-9)
    r = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000))
    p.update("a", 5, 0)  # a failed round: K = 0 pays best now
    assert p.choose([r], [3], 10_000, [1000]) == [0]
    p.count_quiet_steps(p.quiet_steps_left() + 20)  # well past the table's recompute period
    assert p.choose([r], [3], 10_000, [1000]) == [0]
    assert p.quiet_steps_left() == 3  # this step and three more: the refresh gap


@pytest.mark.parametrize("gap", [0, 16])
def test_cost_table_refreshes_at_most_every_refresh_gap_steps_while_speculating(gap):
    # every round is measured while speculating; refreshing the cost table after each one
    # was most of a `choose`: at most every `refresh_gap` steps (0: after every measurement)
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 5, 0.0012)
    p = AdaptivePolicy(5, costs, refresh_gap=gap, plain_refresh=10_000)
    r = R("s")
    refreshes, relative_costs = [], costs.relative_costs
    costs.relative_costs = lambda b, sampled: (refreshes.append(p._steps), relative_costs(b, sampled))[1]
    for i in range(64):
        k = p.choose([r], [10], 10_000, [5000])[0]
        assert k > 0
        p.update("s", k, k)
        costs.observe(1, k, 0.0012 + 1e-6 * (i % 3))  # a measured round
    assert len(refreshes) == (64 if gap == 0 else 64 // gap)
    assert all(b - a >= gap for a, b in zip(refreshes, refreshes[1:]))
    costs.observe(1, 5, 0.1)  # rounds turned dear: seen within the gap
    costs.observe(1, 5, 0.1)
    costs.observe(1, 5, 0.1)
    costs.observe(1, 5, 0.1)
    costs.observe(1, 5, 0.1)
    ks = [p.choose([r], [10], 10_000, [5000])[0] for _ in range(gap + 1)]
    assert ks[-1] == 0
    with pytest.raises(ValueError, match="refresh_gap"):
        AdaptivePolicy(5, costs, refresh_gap=-1)


def test_a_table_priced_from_calibration_alone_is_refreshed_at_the_first_measured_round():
    # the refresh gap applies once a round's cost is known: until then probes come early
    # (calibration may misjudge), and a stale calibrated table would keep them coming
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    p = AdaptivePolicy(5, costs, refresh_gap=16, plain_refresh=10_000)
    r = R("c")
    p.choose([r], [10], 10_000, [5000])
    assert p._table[(1, False)].calibrated_only
    _measure(costs, 1, 5, 0.0012)
    p.choose([r], [10], 10_000, [5000])
    assert not p._table[(1, False)].calibrated_only  # refreshed at once, not 16 steps later


def test_a_plain_decision_after_rounds_stands_while_the_refresh_gap_keeps_the_table():
    # after rounds the cost table is kept (the refresh gap) though the model's version moved
    # on: an all-plain decision made on it must still stand (a standing decision compared
    # with the table's version was dropped at once, so every step ran a full `choose` until
    # the table's refresh), and end when the table is due for its refresh
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.1] * 5})
    _measure(costs, 1, 0, 0.001)
    _measure(costs, 1, 5, 0.0012)
    p = AdaptivePolicy(5, costs, refresh_gap=16, plain_refresh=10_000, prior_a=0.9)
    r = R("q")
    assert p.choose([r], [10], 10_000, [5000])[0] > 0  # speculating at the high prior
    table_step = p._table[(1, False)].step
    for _ in range(15):  # failing rounds, each measured: the version moves past the table's
        p.update("q", 5, 0)
        costs.observe(1, 5, 0.0012)
        if p.choose([r], [10], 10_000, [5000])[0] == 0:
            break
    assert p._steps < table_step + 16
    assert p._table[(1, False)].step == table_step and p._table[(1, False)].version != costs.version  # kept by the gap
    assert p._quiet is not None
    quiet_steps = 0
    while p.quiet([r]):
        quiet_steps += 1
    assert quiet_steps >= 2  # the decision stood
    assert p._steps + 1 <= table_step + 16  # ... until a probe or the table's refresh at the latest
    while p._steps + 1 < table_step + 16:
        p.choose([r], [10], 10_000, [5000])
    p.choose([r], [10], 10_000, [5000])
    assert p._table[(1, False)].version == costs.version  # refreshed there


def _speculating_policy(**kwargs):
    """K=5 rounds cost 1.3 plain steps (n-gram-like), sampled mode measured."""
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.3] * 5})
    for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.0013), (5, 0.0013)):
        costs.observe(1, k, seconds, True)
    return AdaptivePolicy(5, costs, plain_refresh=10_000, max_probe_interval=10_000, **kwargs)


def _sampled(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=1000))


def _at(p: AdaptivePolicy, rid: str, a: float) -> None:
    est = p._lookup(rid, sampled=True)
    est.accepted, est.trials = 10 * a, 10.0
    est.changed()
    p._quiet = None


def test_episode_gain_is_the_starting_steps_prediction_at_the_measured_costs():
    p = _speculating_policy()
    r = _sampled("r")
    _at(p, "r", 0.5)
    assert p.choose([r], [10], 10_000, [1000]) == [5]
    assert p.episode_gain() == pytest.approx(expected_tokens(0.5, 5) / 1.3)
    _at(p, "r", 0.01)
    assert p.choose([r], [10], 10_000, [1000]) == [0]
    assert p.episode_gain() is None  # nobody speculates: no episode starts


def test_episodes_that_fall_short_price_rounds_up_until_marginal_starts_stop():
    # at a = 0.35 a K=5 round is predicted to beat plain decoding by ~17 %; episodes that
    # realized half their predictions make it a loss, and the request stays plain. Greedy
    # batches (another mode) and a policy without calibration are untouched
    p, uncalibrated = _speculating_policy(), _speculating_policy(calibration=None)
    r = _sampled("r")
    assert expected_tokens(0.35, 5) / 1.3 > 1.0 + p.switch_margin
    for policy in (p, uncalibrated):
        _at(policy, "r", 0.35)
        assert policy.choose([r], [10], 10_000, [1000]) == [5]
        for _ in range(10):
            policy.observe_episode(1, True, plain_steps=3.0, realized=1.6, predicted=3.2)
        _at(policy, "r", 0.35)
        policy._est["r"].speculating = False
    assert p.calibration.factor((1, True)) < 0.6
    assert p.choose([r], [10], 10_000, [1000]) == [0]
    assert uncalibrated.choose([r], [10], 10_000, [1000]) == [5]
    assert p._table[(1, True)].raw[5] == pytest.approx(1.3)  # measured costs kept apart
    assert p._table[(1, True)].costs[5] == pytest.approx(1.3 / p.calibration.factor((1, True)))
    _at(p, "r", 0.9)  # a clearly repetitive text still speculates
    assert p.choose([r], [10], 10_000, [1000]) == [5]


def test_a_cost_table_is_priced_again_at_once_only_when_kappa_moves_by_more_than_a_step():
    from infer.spec.policy import KAPPA_STEP
    p = _speculating_policy()
    r = _sampled("r")
    _at(p, "r", 0.5)
    p.choose([r], [10], 10_000, [1000])
    table = p._table[(1, True)]
    p.observe_episode(1, True, plain_steps=1.0, realized=1.9, predicted=2.0)  # kappa moves a little
    assert 0 < 1.0 - p.calibration.factor((1, True)) <= KAPPA_STEP
    assert p._table[(1, True)] is table  # kept until its refresh
    p.observe_episode(1, True, plain_steps=3.0, realized=1.0, predicted=4.0)
    assert (1, True) not in p._table  # priced again at the next choose
    p._quiet = None
    p.choose([r], [10], 10_000, [1000])
    kappa = p.calibration.factor((1, True))
    assert p._table[(1, True)].kappa == pytest.approx(kappa) and kappa < 1.0 - KAPPA_STEP


def test_a_mode_locked_out_by_a_low_kappa_is_tried_again_as_its_evidence_relaxes():
    # episodes that fell far short leave no K paying even at the optimistic acceptance: no
    # shadow drafts then, and no episode to raise kappa; its evidence relaxes toward the
    # prior with the policy's steps, and the mode is worth shadowing again
    from infer.spec.episodes import GainCalibration
    p = _speculating_policy(calibration=GainCalibration(half_life=200.0))
    r = _sampled("r")
    _at(p, "r", 0.5)
    p.choose([r], [10], 10_000, [1000])
    for _ in range(40):
        p.observe_episode(1, True, plain_steps=3.0, realized=0.6, predicted=3.0)
    p._quiet = None
    p.choose([r], [10], 10_000, [1000])
    assert not p.worth_shadowing(1, True) and p.worth_shadowing(1, False)
    p._steps += 10 * p.recompute_every  # plain steps in stretches (`count_quiet_steps`),
    p.costs.observe(1, 0, 0.001, True)  # one of them timed for the baseline
    p._quiet = None
    p.choose([r], [10], 10_000, [1000])  # the table is priced again: relaxed
    assert p.worth_shadowing(1, True)


@pytest.mark.parametrize("stagger", [0, 17])
def test_a_batchs_requests_share_the_probe_budget(stagger):
    # a probe's step costs the whole batch: four requests whose drafts all fail spend, in
    # probe steps, about what one request alone does, whether they probe together (a step
    # shared: each charged its share) or apart (requests that joined at different steps).
    # Before, each request had the whole budget: apart, four times the probe steps
    costs = CostModel(4, draft_ratio={1: 0.2, 4: 0.2}, verify_ratio={1: [1.0] * 5, 4: [1.0] * 5})
    for b in (1, 4):
        _measure(costs, b, 0, 0.001)
        _measure(costs, b, 1, 0.0013)  # r(1) = 1.3 at either size
        _measure_switch(costs, b, 0.0005)

    def probe_spend(batch: int) -> float:
        """Plain steps' time the probe rounds cost beyond plain steps (r(K) - 1 each, and a
        catch-up unit for each prober: catch-ups grow with the requests that run them)."""
        p = AdaptivePolicy(4, costs)
        rs = [R(f"w{i}") for i in range(batch)]
        for n in range(1, batch + 1):  # the requests join one by one, `stagger` steps apart
            for _ in range(max(stagger, 30) if n == batch else stagger):
                for r, k in zip(rs[:n], p.choose(rs[:n], [10] * n, 10_000, [50_000] * n)):
                    p.update(r.request_id, k, 0)  # every draft rejected
        spent, steps = 0.0, 0
        for _ in range(4000):
            ks = p.choose(rs, [10] * batch, 10_000, [50_000] * batch)
            if any(ks):  # (the batch's probe K may differ from one request's: what could pay differs)
                spent += costs.relative_costs(batch)[max(ks)] - 1.0 + costs.switch_cost(batch) * sum(map(bool, ks))
                steps += 1
            for r, k in zip(rs, ks):
                p.update(r.request_id, k, 0)
        assert steps >= 4
        return spent

    alone, four = probe_spend(1), probe_spend(4)
    assert alone / 2 <= four <= 1.5 * alone


def _batch_policy(batch: int, r_k: float, **kwargs) -> AdaptivePolicy:
    """Sampled-mode costs at batch 1 and at `batch`: K=5 rounds cost 1.3 plain steps alone
    and `r_k` in the batch (a round costs the whole batch)."""
    costs = CostModel(5, draft_ratio={1: 0.0, batch: 0.0}, verify_ratio={1: [1.0] + [1.3] * 5,
                                                                           batch: [1.0] + [r_k] * 5})
    for b, r in ((1, 1.3), (batch, r_k)):
        for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.001 * r), (5, 0.001 * r)):
            costs.observe(b, k, seconds, True)
    kwargs.setdefault("calibration", None)
    return AdaptivePolicy(5, costs, plain_refresh=10_000, max_probe_interval=10_000, **kwargs)


def test_a_round_must_pay_for_the_whole_batch():
    # one request drafting well (a = 0.8: K=5 alone would beat plain by ~2x) among seven that
    # draft badly: at batch 8 a round costs 2.2 plain steps for everyone, and the batch's
    # expected tokens (3.7 + 7 * 1) fall short of 8 * 2.2, so it decodes plainly; the same
    # request alone speculates, and so does a batch where every request drafts well
    p = _batch_policy(8, 2.2)
    batch = [_sampled(f"r{i}") for i in range(8)]
    _at(p, "r0", 0.8)
    for i in range(1, 8):
        _at(p, f"r{i}", 0.05)
    assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [0] * 8
    assert p._quiet is not None and p._quiet.vetoed
    assert p.episode_gain() is None  # no episode starts
    p._quiet = None
    assert p.choose(batch[:1], [10], 10_000, [1000]) == [5]  # alone it pays
    for i in range(8):
        _at(p, f"r{i}", 0.8)
    ks = p.choose(batch, [10] * 8, 10_000, [1000] * 8)
    assert ks == [5] * 8 and not p._quiet


@pytest.mark.parametrize("r_k", [1.2, 1.35])
def test_riders_draft_the_rounds_k_and_count_in_the_batchs_economics(r_k):
    # one request at a = 0.8 among seven at 0.15 (alone, no K pays for them at these costs).
    # At r(5) = 1.2 the round pays by the good request alone: without riders only it drafts,
    # with riders all eight do (the verification pads every row to the round's width). At
    # 1.35 the round pays only with the riders' expected tokens counted (3.7 + 7 * 1.18
    # against 8 * 1.35 * 1.05), so without riders the batch stays plain
    batch = [_sampled(f"r{i}") for i in range(8)]
    chosen = {}
    for riders in (False, True):
        p = _batch_policy(8, r_k, riders=riders)
        _at(p, "r0", 0.8)
        for i in range(1, 8):
            _at(p, f"r{i}", 0.15)
        assert p.choose(batch[1:2], [10], 10_000, [1000]) == [0]  # alone, a rider's estimate pays nothing
        p._quiet = None
        chosen[riders] = p.choose(batch, [10] * 8, 10_000, [1000] * 8)
        assert not any(p._est[f"r{i}"].speculating for i in range(1, 8))  # riding is no choice to speculate
    assert chosen[True] == [5] * 8
    assert chosen[False] == ([5] + [0] * 7 if r_k == 1.2 else [0] * 8)


def test_riders_keep_their_overflow_guard_and_wait_out_a_miss_or_their_first_evidence():
    p = _batch_policy(4, 1.2, riders=True, shadowed=True)
    batch = [_sampled(f"r{i}") for i in range(4)]
    for i in range(3):
        _at(p, f"r{i}", 0.8 if i == 0 else 0.15)
        p._est[f"r{i}"].seen_trials = 10.0  # shadow drafts were counted
    p._lookup("r3", sampled=True)  # no evidence yet: the first shadow draft decides
    p.no_proposal("r2")  # r2 missed: backing off
    assert p.choose(batch, [10] * 4, 10_000, [1000, 3, 1000, 1000]) == [5, 2, 0, 0]
    assert p.choose(batch[2:], [10] * 2, 10_000, [1000] * 2) == [0, 0]  # no round: nobody rides


@pytest.mark.parametrize("learned, learned_start, speculates", [
    (None, True, False), (0.9, True, True), (0.05, True, False), (0.9, False, False)])
def test_a_shadowed_request_without_evidence_starts_at_a_learned_prior_that_pays(learned, learned_start, speculates):
    # a shadowed request waits for its first shadow draft, unless finished requests of its
    # kind taught a prior at which it would speculate: then it starts there, its estimate
    # that prior (the fixed prior it was created with is no evidence either)
    p = _batch_policy(4, 1.2, shadowed=True, learned_start=learned_start)
    r = _sampled("r")
    p._lookup("r", sampled=True)  # created before anything was learned: the fixed prior
    if learned is not None:
        p._learned[True] = learned
    assert p.choose([r], [10], 10_000, [1000]) == ([5] if speculates else [0])
    if speculates:
        assert p.acceptance("r") == pytest.approx(learned)
        assert p.episode_gain() == pytest.approx(expected_tokens(learned, 5) / 1.3)


@pytest.mark.parametrize("switch, context, pays", [(0.2, 1000, True), (0.5, 1000, False), (2.0, 100, True)])
def test_a_batch_starts_speculating_only_if_its_gain_repays_the_catch_up(switch, context, pays):
    # eight requests at a = 0.8 expect ~29.5 tokens a round against 8 * 2.2 * 1.05 plain
    # steps' worth: ~11 tokens of gain a round, ~176 over `switch_horizon` (16) rounds. Their
    # drafts must first catch up on the whole context (128 tokens a unit, `switch` plain steps
    # each, summed over the requests: a batched chunk costs more with more rows): 8 x 8 units
    # of 1000 tokens at 0.5 plain steps (8 * 32 = 256 tokens' worth) is more than the gain
    # repays (with only the longest context counted, 8 units, it was not), at 0.2 it is not,
    # nor 8 x 1 unit of 100 tokens at 2 plain steps (128)
    p = _batch_policy(8, 2.2, catch_up_units=lambda behind: -(-behind // 128))
    for _ in range(2):
        p.costs.observe_switch(8, 0.001 * switch * 8, 8, True)  # 8 units at `switch` plain steps each
    batch = [_sampled(f"r{i}") for i in range(8)]
    for i in range(8):
        _at(p, f"r{i}", 0.8)
    assert p.choose(batch, [context] * 8, 10_000, [1000] * 8) == ([5] * 8 if pays else [0] * 8)
    if pays:  # once speculating, the catch-up is behind it: the stay margin alone
        assert p.choose(batch, [context + 4] * 8, 10_000, [1000] * 8) == [5] * 8


def test_a_batch_held_plain_by_its_economics_is_asked_again_after_veto_hold_steps():
    # a request's new shadow evidence does not end the batch's plain decision (each ask is a
    # full choose over the batch); it is asked again `veto_hold` steps later, and speculates
    # if the batch pays by then
    p = _batch_policy(8, 2.2, shadowed=True, veto_hold=16)
    batch = [_sampled(f"r{i}") for i in range(8)]
    for i in range(8):
        _at(p, f"r{i}", 0.8 if i == 0 else 0.05)
        p._est[f"r{i}"].seen_trials = 10.0  # shadow drafts were counted
    assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [0] * 8
    assert p._quiet.vetoed
    for i in range(8):
        p.observe_shadow(f"r{i}", 5, 5)  # every request's draft came true
    steps = 1
    while p.quiet(batch):
        steps += 1
    assert steps == 16
    assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [5] * 8


def test_a_batch_vetoed_again_and_again_is_asked_ever_less_often():
    # one request drafting well among seven that do not: each full choose vetoes the round;
    # the hold doubles with each veto at the bucket and mode (16, 32, 64 ... up to
    # max_veto_hold), the next batch there included, and speculation starting there (the
    # others' drafts came to pay) starts the holds over
    p = _batch_policy(8, 2.2, veto_hold=16, max_veto_hold=64)
    batch = [_sampled(f"r{i}") for i in range(8)]
    for i in range(8):
        _at(p, f"r{i}", 0.8 if i == 0 else 0.05)
    holds = []
    for _ in range(4):
        assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [0] * 8 and p._quiet.vetoed
        holds.append(p.quiet_steps_left() + 1)
        while p.quiet(batch):
            pass
    assert holds == [16, 32, 64, 64]
    other = [_sampled(f"q{i}") for i in range(8)]  # a new batch at the same bucket and mode
    for i in range(8):
        _at(p, f"q{i}", 0.8 if i == 0 else 0.05)
    assert p.choose(other, [10] * 8, 10_000, [1000] * 8) == [0] * 8 and p.quiet_steps_left() + 1 == 64
    while p.quiet(other):
        pass
    for i in range(1, 8):
        _at(p, f"r{i}", 0.8)
    assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [5] * 8 and not p._vetoes
    for i in range(1, 8):
        _at(p, f"r{i}", 0.05)
    p._choice = None  # (a round ran; the estimates fell)
    assert p.choose(batch, [10] * 8, 10_000, [1000] * 8) == [0] * 8 and p._quiet.vetoed
    assert p._vetoes == {(8, True): 1} and p.quiet_steps_left() + 1 <= 16  # held 16 at most: started over
    with pytest.raises(ValueError, match="max_veto_hold"):
        AdaptivePolicy(5, CostModel(5), veto_hold=32, max_veto_hold=16)


def test_what_could_pay_at_a_batch_size_uses_the_batchs_typical_acceptance():
    # sampled requests' prior is 0.3; at batch 8 rounds cost 2.2 plain steps: even with one
    # request at the optimistic 0.9, the rest at 0.3 + batch_optimism cannot pay, so no shadow
    # drafts there (no n-gram upkeep); alone a request could, and a batch whose kind learned
    # a high acceptance could too
    p = _batch_policy(8, 2.2, shadowed=True)
    r = _sampled("solo")
    p.choose([r], [10], 10_000, [1000])
    p.choose([_sampled(f"r{i}") for i in range(8)], [10] * 8, 10_000, [1000] * 8)
    assert p.worth_shadowing(1, True) and not p.worth_shadowing(8, True)
    assert p._table[(8, True)].budget == pytest.approx(p.probe_budget / 10 / 8)  # only re-measuring
    p._learned[True] = 0.85  # finished requests accepted most drafts
    p._table.clear()
    p._quiet = None
    p.choose([_sampled(f"q{i}") for i in range(8)], [10] * 8, 10_000, [1000] * 8)
    assert p.worth_shadowing(8, True)


def test_what_could_pay_for_a_batch_of_one_is_the_single_requests_best_k():
    from infer.spec.policy import _could_pay
    for costs in ([1.0, 1.3, 1.4, 1.5, 1.6, 1.7], [1.0, 2.0, 2.2, 2.4, 2.6, 2.8], [1.0] + [5.0] * 5):
        for a in (0.2, 0.6, 0.9):
            assert _could_pay(a, 0.0, 1, costs, 0.05) == best_k_for_costs(a, costs, 0.05)
    assert _could_pay(0.9, 0.3, 32, [1.0, 2.0, 2.2, 2.4, 2.6, 2.8], 0.05) == 0
    assert _could_pay(0.9, 0.8, 32, [1.0, 2.0, 2.2, 2.4, 2.6, 2.8], 0.05) > 0


def test_upkeep_is_a_plain_steps_share_kept_once_measured():
    costs = CostModel(5, max_age=4)
    _measure(costs, 8, 0, 0.002)
    assert costs.upkeep(8) == 0.0  # unknown
    costs.observe_upkeep(8, 0.0005)
    costs.observe_upkeep(8, 0.0005)
    assert costs.upkeep(8) == pytest.approx(0.25)
    for _ in range(10):  # plain steps measured long after: the upkeep's sample expired
        costs.observe(8, 0, 0.002)
    assert costs.upkeep(8) == pytest.approx(0.25)  # (where it priced shadows out, none measure it again)
    assert costs.upkeep(8, sampled=True) == 0.0  # per sampling mode


def test_shadows_must_also_pay_for_their_upkeep():
    # alone, K=5 at the optimistic acceptance would beat plain decoding by 3.6x (r(5) = 1.3):
    # shadows are worth taking; if taking them and keeping the tables up costs more than
    # speculation could gain, they are not
    p = _batch_policy(8, 2.1, shadowed=True)
    r = _sampled("solo")
    p.choose([r], [10], 10_000, [1000])
    assert p.worth_shadowing(1, True)
    p.costs.observe_upkeep(1, 0.003, True)
    p.costs.observe_upkeep(1, 0.003, True)  # 3 plain steps of upkeep a step
    p._table.clear()
    p._quiet = None
    p.choose([r], [10], 10_000, [1000])
    assert not p.worth_shadowing(1, True)


def test_shadows_pause_where_no_speculation_started_within_their_patience():
    # K=5 rounds at batch 8 cost 1.2 plain steps: by the gate's optimistic premise shadows
    # could pay there. Where `shadow_patience` plain steps took shadows at a bucket and mode
    # without the batch speculating, they stop for `shadow_pause` policy steps (their
    # upkeep is all they cost), then are tried again; other buckets and modes keep theirs
    p = _batch_policy(8, 1.2, shadowed=True, shadow_patience=10, shadow_pause=100)
    assert p.worth_shadowing(8, True)
    p.count_shadowed(8, True, 10)
    p.count_shadowed(8, False, 50)  # another mode's steps: its own patience
    p._steps += 500  # steps elsewhere (other buckets, no shadows) do not count
    assert p.worth_shadowing(8, True)
    p.count_shadowed(7, True, 1)  # (batch 7: bucket 8)
    assert not p.worth_shadowing(8, True)  # patience spent: paused
    assert p.worth_shadowing(1, True)
    p._steps += 99
    assert not p.worth_shadowing(8, True)
    p._steps += 1
    assert p.worth_shadowing(8, True)  # the pause is over: tried again, patience anew
    p.count_shadowed(8, True, 11)
    assert not p.worth_shadowing(8, True)
    off = _batch_policy(8, 1.2, shadowed=True, shadow_patience=0)
    off.count_shadowed(8, True, 10_000)
    assert off.worth_shadowing(8, True)  # 0: never paused


def test_speculation_starting_at_a_bucket_with_a_round_restarts_its_shadows_patience():
    # `started` (the runner: a round verified drafts, an episode opened) restarts the
    # patience and ends a pause; a choice that starts speculating does not by itself (its
    # lookups may all miss: then nothing started)
    p = _batch_policy(8, 1.2, shadowed=True, shadow_patience=10, shadow_pause=100)
    batch = [_sampled(f"r{i}") for i in range(8)]
    p.count_shadowed(8, True, 8)
    for r in batch:
        _at(p, r.request_id, 0.9)
        p._est[r.request_id].seen_trials = 10.0  # shadow evidence counted
    assert all(p.choose(batch, [10] * 8, 10_000, [1000] * 8))  # speculation is to start ...
    p.count_shadowed(8, True, 3)
    assert not p.worth_shadowing(8, True)  # ... but no round ran: 11 steps, paused
    p.started(8, True)  # a round ran: the pause ends, patience anew
    assert p.worth_shadowing(8, True)
    p.count_shadowed(8, True, 10)
    p.started(4, True)  # (another bucket's start: not this one's)
    assert p.worth_shadowing(8, True)
    p.count_shadowed(8, True, 1)  # 11 since its start
    assert not p.worth_shadowing(8, True)


def test_a_table_dropped_when_kappa_moved_is_priced_again_by_the_shadow_gate():
    # an episode that moved kappa drops its mode's table; the gate prices it again rather
    # than taking it as unknown (before: shadows, and at W2 the next prefill's 32 table
    # builds, until the next choose)
    from infer.spec.episodes import GainCalibration
    p = _batch_policy(8, 2.2, shadowed=True, calibration=GainCalibration())
    p.choose([_sampled(f"r{i}") for i in range(8)], [10] * 8, 10_000, [1000] * 8)
    assert not p.worth_shadowing(8, True)
    p.observe_episode(8, True, plain_steps=3.0, realized=0.5, predicted=3.0)
    assert (8, True) not in p._table
    assert not p.worth_shadowing(8, True)
    assert (8, True) in p._table


def test_a_request_leaving_a_plain_batch_keeps_the_decision_for_the_rest():
    # nobody wants to speculate: a request leaving keeps the standing all-plain decision for
    # the rest (no full `choose` after each finish), unless the rest fall into another cost
    # bucket (where no plain cost is known here) or sampling mode, or the batch was held
    # plain by its economics and changes bucket: then the decision stays as it was, for the
    # runner to end
    p = _batch_policy(8, 2.2)
    batch = [_sampled(f"r{i}") for i in range(6)]
    for i in range(6):
        _at(p, f"r{i}", 0.05)
    assert p.choose(batch, [10] * 6, 10_000, [1000] * 6) == [0] * 6
    quiet = p._quiet
    assert quiet is not None and not quiet.vetoed
    left = p.quiet_steps_left()
    assert not p.keep_quiet_without(_sampled("stranger")) and p._quiet is quiet
    assert p.keep_quiet_without(batch[2])  # 6 -> 5: bucket 8 both
    rest = batch[:2] + batch[3:]
    assert not p.holds_quiet(batch[2]) and all(p.holds_quiet(r) for r in rest)
    assert p.quiet_steps_left() == left  # the same decision, until the same step
    assert p.quiet(rest) and not p.quiet(batch)
    assert not p.keep_quiet_without(rest[0])  # 5 -> 4: bucket 4, another table
    assert p._quiet.batch == rest  # left as it was
    # the only sampled request leaving a greedy batch changes its mode
    p._quiet = None
    mixed = [_sampled("s")] + [R(f"g{i}") for i in range(6)]
    for r in mixed[1:]:
        _at(p, r.request_id, 0.05)
    assert p.choose(mixed, [10] * 7, 10_000, [1000] * 7) == [0] * 7
    assert not p.keep_quiet_without(mixed[0]) and p.keep_quiet_without(mixed[1])
    # a batch held plain by its economics: held until it is asked again as planned within
    # the bucket (one request fewer), re-asked at once in another
    p._quiet = None
    _at(p, "r0", 0.8)
    assert p.choose(batch, [10] * 6, 10_000, [1000] * 6) == [0] * 6 and p._quiet.vetoed
    left = p.quiet_steps_left()
    assert p.keep_quiet_without(batch[3]) and p._quiet.vetoed and p.quiet_steps_left() == left
    rest = batch[:3] + batch[4:]
    assert p._quiet.batch == rest and not p.keep_quiet_without(rest[0]) and p._quiet.batch == rest


@pytest.mark.parametrize("round_at_4, a_rest, keeps", [(50.0, 0.05, True), (50.0, 0.9, True),
                                                       (1.3, 0.05, True), (1.3, 0.9, False)])
def test_a_plain_decision_survives_a_bucket_change_where_nobody_would_start(round_at_4, a_rest, keeps):
    # 5 -> 4 requests: the rest fall into bucket 4. The decision holds for them with bucket
    # 4's table (no full `choose`, no steps outside a stretch) where none of them would start
    # speculating there: where a round costs 50 plain steps nobody could (could_pay 0), where
    # it costs 1.3 those drafting badly would not. One that drafts well (0.9, vetoed by batch
    # 5's economics until then) would start at 4: the decision is left for the runner to end
    p = _batch_policy(8, 2.2)
    for k, seconds in ((0, 0.001), (0, 0.001), (5, 0.001 * round_at_4), (5, 0.001 * round_at_4)):
        p.costs.observe(4, k, seconds, True)
    batch = [_sampled(f"r{i}") for i in range(5)]
    for i in range(5):
        _at(p, f"r{i}", 0.05)
    assert p.choose(batch, [10] * 5, 10_000, [1000] * 5) == [0] * 5
    for i in range(1, 5):  # (evidence since the choice, as rounds' or shadows' would be)
        est = p._est[f"r{i}"]
        est.accepted, est.trials = 10 * a_rest, 10.0
    quiet = p._quiet
    left = p.quiet_steps_left()
    at_4 = p._cost_table(4, True)
    assert (at_4.could_pay == 0) == (round_at_4 == 50.0)
    assert p.keep_quiet_without(batch[0]) == keeps
    if keeps:
        assert p._quiet.batch == batch[1:] and p._quiet.table is at_4
        assert p.quiet_steps_left() == left and p.quiet(batch[1:])
    else:
        assert p._quiet is quiet
        assert p.choose(batch[1:], [10] * 4, 10_000, [1000] * 4) == [5] * 4  # as `choose` decides


def test_best_k_for_costs_agrees_with_pricing_each_k_by_the_papers_formula():
    # the one-loop argmax (terms summed as it goes) picks what pricing every K with
    # expected_tokens does, the shortest among equals, with and without a margin (near-ties
    # apart, where the two float sums may round either way)
    from infer.spec.policy import _best_by_score
    rng = random.Random(11)
    checked = 0
    for _ in range(5000):
        costs = [1.0] + [rng.choice([rng.uniform(0.5, 6.0), 1.0, 2.0]) for _ in range(rng.randint(1, 8))]
        a = rng.choice([0.0, 1.0, rng.random(), round(rng.random(), 1)])
        margin = rng.choice([0.0, 0.05])
        scores = [expected_tokens(a, k) / r for k, r in enumerate(costs)]
        top = sorted(scores, reverse=True)
        if len(top) > 1 and abs(top[0] - top[1]) <= 1e-9 * top[0] and top[0] != top[1]:
            continue
        if abs(top[0] - scores[0] * (1 + margin)) <= 1e-9:
            continue
        assert best_k_for_costs(a, costs, margin) == _best_by_score(scores, margin), (a, costs, margin)
        checked += 1
    assert checked > 3500
    assert best_k_for_costs(0.5, [1.0, 2.0, 2.0]) == 0 and best_k_for_costs(0.0, [1.0] * 4) == 0
    assert best_k_for_costs(1.0, [1.0, 1.0, 1.0]) == 2


def _table_policy(batch: int, plain_seconds: float, rate: float | None) -> AdaptivePolicy:
    """A policy that knows a plain step's cost at `batch` and, unless None, the rate its
    episodes realized there (greedy)."""
    policy = AdaptivePolicy(5, CostModel(5), table_by_realized=rate is not None)
    for _ in range(2):
        policy.costs.observe(batch, 0, plain_seconds)
    if rate is not None:
        assert policy.calibration is not None
        policy.calibration.observe((CostModel.bucket(batch), False), 50.0, realized=50.0 * rate, predicted=60.0)
    return policy


def test_a_table_is_built_only_where_speculation_can_pay_for_it():
    # saving: tokens_left * plain / batch * (1 - 1 / rate); cost: (indexed + left) tokens at
    # seconds_per_token, by the switch margin
    u = 3e-6
    wide = _table_policy(32, 1.2e-3, rate=1.2)  # rounds at 32 won little: 6.25 us a token
    assert not wide.table_pays(32, False, 100, 500, u)  # 0.6 ms saved against 1.8 ms
    assert wide.table_pays(32, False, 2000, 50, u)  # a long output left pays for a short prompt
    assert not _table_policy(32, 1.2e-3, rate=0.9).table_pays(32, False, 10_000, 10, u)  # rounds lost there
    alone = _table_policy(1, 0.5e-3, rate=2.0)  # batch 1, rounds won: 250 us a token
    assert alone.table_pays(1, False, 100, 500, u)
    assert not alone.table_pays(1, False, 100, 500, 1e-3)  # ... unless tables cost that much a token
    assert not alone.table_pays(1, False, 0, 500, u)  # nothing left to emit


def test_where_speculation_is_untried_a_table_is_priced_at_what_rounds_would_give():
    # no episodes lately at this batch size (or none measured at all): the rate is the best
    # any K gives at `batch_acceptance` with the cost table's rounds
    u = 3e-6
    untried = _table_policy(32, 1.2e-3, rate=None)
    for _ in range(2):
        untried.costs.observe(32, 5, 2.4e-3)  # rounds cost two plain steps at 32
    untried.costs.observe(32, 1, 2.4e-3)
    untried.costs.observe(32, 1, 2.4e-3)
    untried._learned[False] = 0.8  # greedy requests accepted 0.8: 0.95 for the batch, K=5 pays ~2.6x
    assert untried.table_pays(32, False, 200, 300, u)
    untried._learned[False] = 0.1  # they accepted 0.1: no K beats plain decoding
    untried._table.clear()
    assert not untried.table_pays(32, False, 10_000, 10, u)
    untried.calibration = None  # (no episodes measured at all: the same)
    assert not untried.table_pays(32, False, 10_000, 10, u)


def test_a_table_is_priced_by_what_a_drafting_request_would_realize_not_the_batchs_diluted_rate():
    # episodes at 32 realized 1.05 tokens per request of the batch (most rows had no table
    # and emitted one token a round), yet rounds cost two plain steps and requests of this
    # kind accepted 0.8: a drafting request realizes ~2.6x. By default that prices the table;
    # `table_by_realized` takes the batch's rate and refuses it
    u = 3e-6
    for by_realized in (False, True):
        p = _table_policy(32, 1.2e-3, rate=1.05)
        p.table_by_realized = by_realized
        for _ in range(2):
            p.costs.observe(32, 5, 2.4e-3)
            p.costs.observe(32, 1, 2.4e-3)
        p._learned[False] = 0.8
        assert p.table_pays(32, False, 200, 300, u) is not by_realized


def test_tables_are_built_while_no_plain_cost_is_known():
    unmeasured = _table_policy(16, 1.2e-3, rate=None)
    assert unmeasured.calibration is not None
    unmeasured.calibration.observe((32, False), 50.0, realized=50.0, predicted=60.0)
    assert unmeasured.table_pays(32, False, 10, 500, 3e-6)  # episodes at 32, but no plain step's cost there


def test_extend_latest_adds_to_the_latest_measurement_of_its_kind():
    costs = CostModel(2)
    costs.observe(4, 1, 0.002)
    costs.observe(4, 1, 0.004)
    assert costs.step_seconds(4, 1) == pytest.approx(0.002)
    costs.extend_latest(4, 1, 0.001)
    costs.extend_latest(4, 1, 0.0)  # (nothing to add)
    assert sorted(costs._samples[("step", (4, 1, False))]) == pytest.approx([0.002, 0.005])
    costs.observe(4, 1, 0.0015)
    costs.extend_latest(4, 1, 0.001)  # the lower median moves with the extended sample
    assert costs.step_seconds(4, 1) == pytest.approx(0.0025)
    costs.extend_latest(8, 1, 0.001)  # a kind never measured: nothing to extend
    assert ("step", (8, 1, False)) not in costs._samples


def test_an_early_probe_must_cost_little_against_the_tokens_its_request_has_left():
    # only calibration prices rounds here: a request probes early to measure them, but not
    # one whose probe (~10 plain steps) would cost more than early_probe_share of its
    # remaining steps (a batch entering a new size near the end of its requests)
    def probes(tokens_left: int, share: float = 0.05) -> int:
        costs = CostModel(4, draft_ratio={1: 3.0}, verify_ratio={1: [1.0] * 5})
        _measure(costs, 1, 0, 0.001)
        p = AdaptivePolicy(4, costs, early_probe_share=share)
        return sum(bool(p.choose([R("e")], [10], 10_000, [tokens_left])[0]) for _ in range(6))

    assert probes(5000) == 1 and probes(400) == 1
    assert probes(100) == 0  # 10 plain steps > 5 % of 100
    assert probes(100, share=0.2) == 1
    with pytest.raises(ValueError, match="early_probe_share"):
        AdaptivePolicy(4, CostModel(4), early_probe_share=1.5)
