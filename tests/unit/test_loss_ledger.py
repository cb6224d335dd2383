"""The loss ledger (spec/loss_ledger.py) and the adaptive policy's locks."""

from __future__ import annotations

import pytest

from infer.engine.request import Request
from infer.sampling import SamplingParams
from infer.spec.loss_ledger import LossLedger
from infer.spec.policy import AdaptivePolicy, CostModel

A, B = (32, False), (1, False)
PLAIN = 0.001  # seconds a plain step


def _ledger(**kwargs) -> LossLedger:
    return LossLedger(**{"budget": 0.01, "min_steps": 100, "window": 10_000, "lock_steps": 500, **kwargs})


def test_a_key_that_lost_more_than_its_budget_is_locked_for_lock_steps():
    ledger = _ledger()
    # 200 steps elapsed at 1 ms: the budget is 2 ms
    assert not ledger.charge(A, 0.0015, 200, PLAIN)
    assert not ledger.locked(A, 200)
    assert ledger.charge(A, 0.001, 210, PLAIN)  # 2.5 ms > 1 % of 210 ms
    assert ledger.locked(A, 210) and ledger.locked(A, 709) and not ledger.locked(A, 710)
    assert ledger.lock_end(A) == 710
    assert ledger.loss(A) == 0.0  # a lock clears the key's loss: tried afresh after it
    assert not ledger.locked(B, 210)


def test_nothing_is_locked_before_min_steps():
    ledger = _ledger()
    assert not ledger.charge(A, 1.0, 99, PLAIN)  # a huge loss, but too early to judge
    assert ledger.charge(A, 0.0, 100, PLAIN)


def test_locks_in_a_row_double_up_to_the_cap_and_a_gain_starts_them_over():
    ledger = _ledger(max_lock_steps=1500)
    ends = []
    step = 200
    for _ in range(4):
        assert ledger.charge(A, 1.0, step, PLAIN)
        ends.append(ledger.lock_end(A) - step)
        step = ledger.lock_end(A)
    assert ends == [500, 1000, 1500, 1500]
    ledger.charge(A, -1.0, step, PLAIN)  # the key gains: its next lock is short again
    assert not ledger.locked(A, step)
    ledger.charge(A, 2.0, step + 1, PLAIN)
    assert ledger.lock_end(A) - (step + 1) == 500


def test_a_gaining_key_is_never_locked_and_keys_are_judged_together():
    ledger = _ledger()
    # each of A and C lost 1.2 ms in 200 ms (under the 2 ms budget alone), together 2.4 ms
    c = (16, False)
    ledger.charge(B, -0.0001, 200, PLAIN)
    ledger.charge(A, 0.0012, 200, PLAIN)
    assert ledger.charge(c, 0.0012, 200, PLAIN)
    assert ledger.locked(A, 200) and ledger.locked(c, 200) and not ledger.locked(B, 200)
    # a large gain elsewhere does not shield a key that alone lost more than the budget
    ledger = _ledger()
    ledger.charge(B, -1.0, 200, PLAIN)
    assert ledger.charge(A, 0.003, 200, PLAIN)
    assert ledger.locked(A, 200) and not ledger.locked(B, 200)


def test_the_sums_halve_every_window():
    ledger = _ledger(window=1000)
    ledger.charge(A, -0.004, 500, PLAIN)
    assert ledger.elapsed == pytest.approx(0.5)
    ledger.charge(A, 0.0, 1000, PLAIN)
    assert ledger.loss(A) == pytest.approx(-0.002) and ledger.elapsed == pytest.approx(0.75)


@pytest.mark.parametrize("kwargs", [dict(budget=0.0), dict(budget=1.0), dict(min_steps=0),
                                    dict(min_steps=10, window=5), dict(lock_steps=0),
                                    dict(lock_steps=10, max_lock_steps=5)])
def test_bad_ledger_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        LossLedger(**kwargs)


# -- the policy under a lock ------------------------------------------------------------------------

def _policy() -> AdaptivePolicy:
    """K=5 rounds at 1.3 plain steps (n-gram-like) at batch sizes 1-4, sampled; shadowed."""
    costs = CostModel(5, draft_ratio={1: 0.0}, verify_ratio={1: [1.0] + [1.3] * 5})
    for batch in (1, 2, 4):
        for k, seconds in ((0, PLAIN), (0, PLAIN), (5, 1.3 * PLAIN), (5, 1.3 * PLAIN)):
            costs.observe(batch, k, seconds, True)
    ledger = LossLedger(min_steps=1, lock_steps=1000)
    return AdaptivePolicy(5, costs, plain_refresh=10_000, max_probe_interval=10_000, shadowed=True, riders=True,
                          ledger=ledger)


def _sampled(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=1000))


def _evident(p: AdaptivePolicy, rid: str, a: float) -> None:
    """Shadow evidence at acceptance `a`: enough that the request would speculate at high a."""
    for _ in range(10):
        p.observe_shadow(rid, 10, round(10 * a))


def test_a_locked_batch_decodes_plainly_until_the_lock_ends_whatever_the_evidence():
    p = _policy()
    reqs = [_sampled("a"), _sampled("b"), _sampled("c")]
    for r in reqs:
        _evident(p, r.request_id, 0.9)
    lens, left = [10] * 3, [1000] * 3
    assert any(p.choose(reqs, lens, 10_000, left))  # good drafts: the batch speculates
    p.charge(3, True, 1.0)  # then a second lost, against little elapsed: locked
    assert p._lock_end(3, True) is not None and p._lock_end(1, True) is None
    assert p.choose(reqs, lens, 10_000, left) == [0, 0, 0]
    end = p.ledger.lock_end((4, True))
    assert p.quiet_steps_left() == end - 1 - p._steps
    # new evidence, a found draft: the decision stands (a vetoed one would too)
    p.observe_shadow("a", 5, 5)
    p.proposal_ready("b")
    assert p.quiet(reqs)
    # no shadows, no tables at a locked key; other keys as before
    assert not p.worth_shadowing(3, True) and not p.table_pays(3, True, 1000, 10, 1e-9)
    assert p.worth_shadowing(1, True) and p.table_pays(1, True, 1000, 10, 1e-9)
    p.count_quiet_steps(end - p._steps - 1)
    assert not p.quiet(reqs) and any(p.choose(reqs, lens, 10_000, left))  # the lock ended


def test_a_finish_under_a_lock_keeps_it_into_a_locked_key_and_ends_it_into_an_open_one():
    p = _policy()
    reqs = [_sampled("a"), _sampled("b"), _sampled("c")]
    for r in reqs:
        _evident(p, r.request_id, 0.9)
    p._steps = 10  # (the ledger judges from its `min_steps` on)
    p.charge(3, True, 1.0)
    p.charge(2, True, 1.0)
    assert p._lock_end(3, True) is not None and p._lock_end(2, True) is not None
    assert p.choose(reqs, [10] * 3, 10_000, [1000] * 3) == [0, 0, 0]
    assert p.keep_quiet_without(reqs[2])  # batch 2: its own lock takes over
    assert p._quiet.locked and p._quiet.until == p.ledger.lock_end((2, True))
    assert not p.keep_quiet_without(reqs[1])  # batch 1, not locked: decided afresh
    # an ordinary plain decision whose rest falls into a locked key becomes a locked one
    p = _policy()
    p._steps = 10
    p.charge(2, True, 1.0)
    reqs = [_sampled("a"), _sampled("b"), _sampled("c")]
    assert p.choose(reqs, [10] * 3, 10_000, [1000] * 3) == [0, 0, 0]  # no evidence yet: plain
    assert not p._quiet.locked
    assert p.keep_quiet_without(reqs[0])
    assert p._quiet.locked and p._quiet.until == p.ledger.lock_end((2, True))


def test_charges_price_elapsed_steps_at_the_batch_sizes_plain_step():
    p = _policy()
    p._steps = 50
    p.charge(1, True, 0.0)
    assert p.ledger.elapsed == pytest.approx(50 * PLAIN)
    p.charge(8, True, 0.5)  # no plain step known at batch 8: nothing charged
    assert p.ledger.loss((8, True)) == 0.0
    p.ledger = None
    p.charge(1, True, 1.0)  # no ledger: nothing happens


def test_the_server_exports_the_ledgers_locks():
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from infer.server.metrics import _ledger_metrics

    def read(policy):
        locks, locked = list(_ledger_metrics(policy))
        assert isinstance(locks, CounterMetricFamily) and isinstance(locked, GaugeMetricFamily)
        return locks.samples[0].value, {(s.labels["bucket"], s.labels["sampled"]): s.value for s in locked.samples}

    assert read(None) == (0, {})  # no adaptive policy: zero, no keys
    p = _policy()
    p._steps = 10
    p.charge(3, True, 1.0)
    assert read(p) == (1, {("4", "true"): 1})
    p._steps = p.ledger.lock_end((4, True))
    assert read(p) == (1, {})  # the lock ended: counted, no longer locked
