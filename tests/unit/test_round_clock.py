"""RoundClock: plain step times and round overheads from step start times (pure, no engine)."""

from __future__ import annotations

import pytest

from infer.speculative.policy import ClockConfig, RoundClock, StepKind, bucket


def _run(clock: RoundClock, steps: list[tuple[int, int, float]], t: float = 0.0) -> float:
    """Feed (batch, k, seconds) steps one after another; returns the time after the last."""
    for batch, k, seconds in steps:
        clock.stepped(t, StepKind(batch, k))
        t += seconds
    return t


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_plain_time_and_round_overhead_are_learnt_per_bucket():
    clock = RoundClock(lambda k: 1.0 + 0.5 * k)
    assert clock.needs_plain(1) and clock.overhead(1) == 0.0
    t = _run(clock, [(1, 0, 0.01)] * 5)
    assert clock.plain_step_s(1) == pytest.approx(0.01) and not clock.needs_plain(1)
    # rounds of k=2 take 0.04 s = 4 plain steps, the model says 2: 2 plain steps of overhead
    _run(clock, [(1, 2, 0.04)] * 30, t)
    assert clock.overhead(1) == pytest.approx(2.0, abs=1e-3)
    assert clock.needs_plain(2) and clock.overhead(4) == 0.0  # other buckets know nothing yet


def test_steps_next_to_the_other_kind_are_not_samples():
    # an overlapped plain step before a round looks free, the one after it looks cheap
    clock = RoundClock(lambda k: 1.0)
    _run(clock, [(1, 0, 0.001), (1, 3, 0.05), (1, 0, 0.002), (1, 3, 0.05), (1, 0, 0.001)])
    assert clock.plain_step_s(1) is None and clock.overhead(1) == 0.0
    t = _run(clock, [(1, 0, 0.01)] * 3 + [(1, 3, 0.03)] * 3, 1.0)
    assert clock.plain_step_s(1) == pytest.approx(0.01)  # only the middle plain step counted
    _run(clock, [(1, 0, 0.01)], t)
    assert clock.overhead(1) == pytest.approx(2.0)  # only the middle round: 3 plain steps, model 1


def test_prefill_steps_and_stalls_are_not_samples():
    clock = RoundClock(lambda k: 1.0, ClockConfig(max_ratio=10.0))
    t = _run(clock, [(1, 0, 0.01)] * 4)
    clock.stepped(t, None)  # a step with prefill in it
    _run(clock, [(1, 0, 5.0), (1, 0, 0.01)], t + 0.01)
    assert clock.plain_step_s(1) == pytest.approx(0.01)
    t = _run(clock, [(1, 0, 0.01), (1, 0, 1.0), (1, 0, 0.01), (1, 0, 0.01)], 10.0)  # 100 plain steps: a stall
    assert clock.plain_step_s(1) == pytest.approx(0.01)


def test_a_bucket_asks_for_plain_steps_again_after_refresh_steps():
    clock = RoundClock(lambda k: 1.0, ClockConfig(refresh_steps=10))
    t = _run(clock, [(1, 0, 0.01)] * 3)
    assert not clock.needs_plain(1)
    _run(clock, [(1, 2, 0.02)] * 10, t)
    assert clock.needs_plain(1)


@pytest.mark.parametrize("kwargs, words", [({"decay": 1.0}, "decay"), ({"refresh_steps": 0}, "refresh_steps"),
                                           ({"max_ratio": 1.0}, "max_ratio")])
def test_clock_config_is_validated(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ClockConfig(**kwargs)
