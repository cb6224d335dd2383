"""Speculation length policies, the paper's speed model and SpecStats: pure functions, no model."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from infer.engine.speculation import guard_k
from infer.speculative.metrics import SpecStats
from infer.speculative.policy import MIN_VERIFY_COST, OVERHEAD_STEP, AdaptiveConfig, AdaptivePolicy, FixedPolicy
from infer.speculative.theory import (GRID_ROWS, alpha_from_mean_length, best_k, best_k_grid, best_k_table,
                                     expected_tokens, walltime_factor)


@dataclass
class R:
    request_id: str


def test_expected_tokens_matches_the_geometric_series():
    for a in (0.0, 0.3, 0.8):
        for k in range(6):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens(1.5, 2)


def test_walltime_factor_is_the_papers_formula():
    a, k, c = 0.8, 4, 0.3
    assert walltime_factor(a, k, c) == pytest.approx((1 - a ** 5) / ((1 - a) * (k * c + 1)))
    assert walltime_factor(0.5, 0, 0.3) == pytest.approx(1.0)
    assert walltime_factor(a, k, c, verify_cost=2.0) == pytest.approx(expected_tokens(a, k) / (k * c + 2.0))


def _direct_table(alphas: list[float], k_max: int, c: float, verify: list[float]) -> list[tuple[int, float]]:
    """The smallest K of the largest walltime factor per acceptance, K = 0 (factor 1) unless one beats it."""
    table = []
    for a in alphas:
        factors = [1.0] + [walltime_factor(a, k, c, verify[k - 1]) for k in range(1, k_max + 1)]
        top = max(factors)
        k = 0 if top <= 1.0 + 1e-12 else next(i for i, f in enumerate(factors) if f >= top - 1e-12)
        table.append((k, factors[k]))
    return table


@pytest.mark.parametrize("c, slope, extra", [(0.0, 0.05, 0.0), (0.4, 0.02, 0.3), (0.09, 0.0, 1.5), (0.6, 0.05, 0.0)])
def test_best_k_table_maximises_the_walltime_factor_at_every_acceptance(c, slope, extra):
    alphas = [i / 100 for i in range(101)]
    verify = [1.0 + slope * k + extra for k in range(1, 9)]
    want = _direct_table(alphas, 8, c, verify)
    assert best_k_table(alphas, 8, c, verify) == want
    assert [best_k(a, 8, c, lambda k: verify[k - 1]) for a in alphas] == want
    assert {k for k, _ in want} != {0}  # (some acceptance pays: the comparison covers K > 0)
    with pytest.raises(ValueError):
        best_k_table(alphas, 8, c, verify[:-1])


def test_best_k_grid_maximises_the_walltime_factor_in_every_row():
    # more rows than are computed at once, costs from nearly free to dearer than any K repays
    rng = random.Random(5)
    alphas = [i / 100 for i in range(101)]
    rows = [[0.05 + 0.1 * i + rng.uniform(0, 0.3) * k for k in range(1, 7)] for i in range(GRID_ROWS + 9)]
    grid = best_k_grid(alphas, 6, 0.2, rows)
    assert grid == [_direct_table(alphas, 6, 0.2, row) for row in rows]
    assert {k for table in grid for k, _ in table} == set(range(7))  # every K wins somewhere, plain too
    with pytest.raises(ValueError, match="verify costs"):
        best_k_grid(alphas, 6, 0.2, [rows[0], rows[1][:-1]])


def test_the_policy_looks_up_any_overhead_as_best_k_computes_it():
    # the tables are built at start for every overhead that changes the choice; beyond them
    # (far below 0, far above K_max plain steps) the nearest table is the same one
    for k_max, c, slope in ((5, 0.0, 0.02), (4, 0.35, 0.1)):
        p = AdaptivePolicy(AdaptiveConfig(k_max=k_max, c=c, verify_slope=slope))
        for overhead in (-1e6, -30.0, -1.1, -0.4, 0.0, 0.26, 1.5, k_max - 0.05, k_max + 0.3, 1e6):
            extra = round(overhead / OVERHEAD_STEP) * OVERHEAD_STEP
            for alpha in (0.0, 0.35, 0.8, 0.97, 1.0):
                k, factor = best_k(alpha, k_max, c, lambda k: max(MIN_VERIFY_COST, 1.0 + slope * k + extra))
                assert p.best(alpha, overhead) == (k if factor >= 1.0 + p.config.min_gain else 0), (overhead, alpha)


def test_best_k_is_zero_when_nothing_pays_and_grows_with_acceptance():
    assert best_k(0.05, 8, 0.5) == (0, 1.0)
    ks = [best_k(a, 8, 0.1)[0] for a in (0.3, 0.6, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0] > 0
    assert best_k(0.7, 8, 0.1, lambda k: 3.0)[0] == 0  # verifying costs 3 plain steps: nothing pays
    k, factor = best_k(0.8, 8, 0.2)
    assert factor == pytest.approx(max(walltime_factor(0.8, j, 0.2) for j in range(1, 9)))
    assert factor == pytest.approx(walltime_factor(0.8, k, 0.2))


def test_tree_model_reduces_to_the_chain_and_grows_with_width():
    from infer.speculative.theory import tree_expected_tokens, tree_walltime_factor
    for a in (0.0, 0.4, 0.9, 1.0):
        assert tree_expected_tokens(a, (1, 1, 1)) == pytest.approx(expected_tokens(a, 3))
        assert tree_walltime_factor(a, (1, 1), 0.3, 1.1) == pytest.approx(walltime_factor(a, 2, 0.3, 1.1))
    assert tree_expected_tokens(0.5, (3,)) == pytest.approx(1 + (1 - 0.5 ** 3))
    assert tree_expected_tokens(0.5, (3, 1)) > tree_expected_tokens(0.5, (2, 1)) > tree_expected_tokens(0.5, (1, 1))
    with pytest.raises(ValueError, match="branching"):
        tree_expected_tokens(0.5, (2, 0))


@pytest.mark.parametrize("alpha, k", [(0.3, 3), (0.75, 5), (0.95, 8)])
def test_alpha_from_mean_length_inverts_eq1(alpha, k):
    assert alpha_from_mean_length(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-6)


def test_guard_k_respects_max_seq_len_and_tokens_left():
    assert guard_k(5, seq_len=10, max_seq_len=100, tokens_left=50) == 5
    assert guard_k(5, seq_len=96, max_seq_len=100, tokens_left=50) == 3  # positions 96..99
    assert guard_k(5, seq_len=99, max_seq_len=100, tokens_left=50) == 0
    assert guard_k(5, seq_len=10, max_seq_len=100, tokens_left=3) == 2


def test_fixed_policy_gives_every_request_k():
    p = FixedPolicy(4)
    assert p.choose([R("a"), R("b")]) == [4, 4]
    p.update("a", 4, 0)
    assert p.choose([R("a")]) == [4] and p.leak_report() == []
    with pytest.raises(ValueError, match="spec_length"):
        FixedPolicy(0)


def _run(policy: AdaptivePolicy, request_id: str, steps: int, accept: float, overhead: float = 0.0) -> list[int]:
    """`steps` steps of one request whose drafts pass with probability `accept` (deterministic:
    the first round(k * accept) of each round pass), rounds costing `overhead` beyond the model."""
    ks = []
    for _ in range(steps):
        (k,) = policy.choose([R(request_id)], overhead)
        if k:
            policy.update(request_id, k, min(k, round(k * accept)))
        ks.append(k)
    return ks


def test_adaptive_speculates_where_drafts_pass_and_picks_the_papers_k():
    cfg = AdaptiveConfig(k_max=8, c=0.1)
    p = AdaptivePolicy(cfg)
    assert p.choose([R("x")])[0] == best_k(cfg.prior_alpha, 8, 0.1)[0]  # the prior
    _run(p, "x", 30, 1.0)
    assert p.acceptance("x") > 0.95 and p.choose([R("x")]) == [best_k(p.acceptance("x"), 8, 0.1)[0]] == [8]


def test_adaptive_turns_a_useless_draft_off_and_probes_ever_less_often():
    cfg = AdaptiveConfig(k_max=5, c=0.3, probe_every=4, probe_max=32)
    p = AdaptivePolicy(cfg)
    ks = _run(p, "x", 400, 0.0)
    rounds = [i for i, k in enumerate(ks) if k]
    assert len(rounds) < 20  # off after a few rounds
    probes = [i for i in rounds if ks[i] == 1 and i > 10]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 32  # waits double up to probe_max
    assert all(k in (0, 1) for k in ks[20:])  # plain, and one-token probes


def test_a_probe_that_finds_good_drafts_brings_speculation_back():
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.2, probe_every=4, probe_max=16))
    _run(p, "x", 100, 0.0)
    assert p.choose([R("x")])[0] in (0, 1)
    ks = _run(p, "x", 60, 1.0)
    assert max(ks[-10:]) == 5 and min(ks[-10:]) == 5


def test_a_round_overhead_measured_beyond_the_model_turns_speculation_down_or_off():
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.1))
    _run(p, "x", 30, 0.75)
    alpha = p.acceptance("x")
    ks = [p.best(alpha, overhead) for overhead in (-0.5, 0.0, 0.5, 1.0, 3.0)]
    assert ks[1] == best_k(alpha, 5, 0.1)[0] > 0 and ks[-1] == 0
    assert ks[:-1] == sorted(ks[:-1])  # a fixed cost a round favours longer drafts, until none pays
    assert p.choose([R("x")], overhead=3.0) == [0] and p.choose([R("x")]) == [ks[1]]
    assert p.round_cost(0) == 1.0 and p.round_cost(2) == pytest.approx(1.2)


def test_probes_draft_what_their_budget_buys_and_passing_probes_keep_coming():
    assert AdaptiveConfig(k_max=5, c=0.0).probe_k == 5  # n-gram: a whole round costs no drafting
    assert AdaptiveConfig(k_max=5, c=0.05).probe_k == 5 and AdaptiveConfig(k_max=5, c=0.1).probe_k == 2
    assert AdaptiveConfig(k_max=5, c=0.45).probe_k == 1
    # rounds that cost half a plain step beyond the model: at the prior nothing pays; probes
    # whose drafts all pass keep coming every probe_every steps, each twice as long, until
    # the estimate says K = 5 pays. Probes that fail stay one token long and back off.
    for accept, want in ((1.0, [0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 4]), (0.0, [0, 0, 0, 1] + [0] * 7 + [1])):
        p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.45, probe_every=4, probe_max=64, probe_share=1.0))
        ks = _run(p, "x", 40, accept, overhead=0.5)
        assert ks[:12] == want
        assert (ks[-10:] == [5] * 10) == (accept == 1.0) and (max(ks) == 1) == (accept == 0.0)


def test_probes_wait_long_enough_to_cost_a_small_share_of_plain_decoding():
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.5, probe_every=16, probe_max=256, probe_share=0.03))
    # a one-token probe costing 0.5 + 2.5 plain steps beyond a plain step: 100 steps apart
    assert p.probe_floor(1, 2.5) == 100 and p.probe_floor(1, 0.0) == 17 and p.probe_floor(1, 20.0) == 256
    assert AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.0)).probe_floor(5, 0.0) == 16  # free: probe_every
    ks = _run(p, "x", 600, 1.0, overhead=2.5)  # probes pass whole, yet no K pays at this overhead
    probes = [i for i, k in enumerate(ks) if k]
    assert len(probes) >= 3 and min(b - a for a, b in zip(probes, probes[1:])) >= 100


def _speedup(cfg: AdaptiveConfig, alpha: float, overhead: float, tokens: int = 20000) -> float:
    """Tokens per plain-step time of a request under `cfg`'s policy, by the policy's own cost
    model: iid acceptance alpha per draft, `overhead` plain steps a round beyond the model."""
    rng, p = random.Random(0), AdaptivePolicy(cfg)
    made = cost = 0.0
    while made < tokens:
        k = p.choose([R("x")], overhead)[0]
        if k == 0:
            made, cost = made + 1, cost + 1
            continue
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        p.update("x", k, accepted)
        made, cost = made + accepted + 1, cost + p.round_cost(k) + overhead
    return made / cost


@pytest.mark.parametrize(("alpha", "c", "overhead"), [(0.71, 0.5, 2.35), (0.71, 0.5, 1.0), (0.5, 0.0, 0.3),
                                                      (0.8, 0.0, 0.3), (0.9, 0.05, 0.2), (0.71, 0.3, 0.5)])
def test_adaptive_never_loses_to_plain_and_keeps_most_of_the_best_fixed_k(alpha: float, c: float,
                                                                          overhead: float) -> None:
    cfg = AdaptiveConfig(k_max=5, c=c, verify_slope=0.05)
    fixed = max(expected_tokens(alpha, k) / (k * c + 1 + 0.05 * k + overhead) for k in range(1, 6))
    got = _speedup(cfg, alpha, overhead)
    assert got >= 0.95 and got >= 0.9 * fixed, (got, fixed)


def test_n_gram_drafts_cost_nothing_so_little_acceptance_pays():
    free = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.0))
    dear = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.5))
    _run(free, "x", 50, 0.2)
    _run(dear, "x", 50, 0.2)
    assert free.choose([R("x")])[0] > 0 and dear.choose([R("x")])[0] == 0


def test_a_proposal_missing_on_a_probe_waits_for_the_next_probe():
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.3, probe_every=4, probe_max=4))
    _run(p, "x", 50, 0.0)
    ks = []
    for _ in range(12):  # every probe finds no draft (drafted 0): one probe every 4 steps, not every step
        (k,) = p.choose([R("x")])
        p.update("x", 0, 0)
        ks.append(k)
    assert ks.count(1) == 3


def test_requests_are_estimated_apart_and_released():
    p = AdaptivePolicy(AdaptiveConfig(k_max=5, c=0.2))
    _run(p, "good", 30, 1.0)
    _run(p, "bad", 30, 0.0)
    assert p.acceptance("good") > 0.9 and p.acceptance("bad") < 0.3 and p.choose([R("bad")]) == [0]
    assert p.leak_report() == ["adaptive policy still tracks ['bad', 'good']"]
    p.release("good")
    p.release("bad")
    assert p.leak_report() == [] and p.acceptance("good") == pytest.approx(p.config.prior_alpha)


@pytest.mark.parametrize("kwargs, words", [({"k_max": 0, "c": 0.1}, "k_max"), ({"k_max": 3, "c": -1}, "c and"),
                                           ({"k_max": 3, "c": 0.1, "decay": 0}, "decay"),
                                           ({"k_max": 3, "c": 0.1, "probe_every": 8, "probe_max": 4}, "probe"),
                                           ({"k_max": 3, "c": 0.1, "probe_share": 0.0}, "probe_share")])
def test_adaptive_config_is_validated(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AdaptiveConfig(**kwargs)


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
