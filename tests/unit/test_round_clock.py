"""RoundClock: plain step times, round overheads and the batch gate from step start times
(pure, no engine)."""

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


def test_a_plain_measurement_is_the_median_of_its_samples():
    # the first plain step timed after a prefill runs slow (0.03): one sample would make a
    # round look three times cheaper against it; the median of three does not
    steps = [(1, 0, 0.01), (1, 0, 0.03), (1, 0, 0.01), (1, 0, 0.01), (1, 0, 0.01)]
    clock = RoundClock(None, gate=True)
    _run(clock, steps)
    assert clock.plain_step_s(1) == pytest.approx(0.01) and not clock.needs_plain(1)
    single = RoundClock(None, ClockConfig(plain_samples=1), gate=True)  # the negative control: what
    _run(single, steps[:3])  # three plain steps timed (one sample) before rounds began
    assert single.plain_step_s(1) == pytest.approx(0.03) and not single.needs_plain(1)
    partial = RoundClock(None, gate=True)
    _run(partial, steps[:4])  # two samples: still measuring
    assert partial.plain_step_s(1) is None and partial.needs_plain(1)


def test_steps_next_to_the_other_kind_are_not_samples():
    # an overlapped plain step before a round looks free, the one after it looks cheap
    clock = RoundClock(lambda k: 1.0, ClockConfig(plain_samples=1))
    _run(clock, [(1, 0, 0.001), (1, 3, 0.05), (1, 0, 0.002), (1, 3, 0.05), (1, 0, 0.001)])
    assert clock.plain_step_s(1) is None and clock.overhead(1) == 0.0
    t = _run(clock, [(1, 0, 0.01)] * 3 + [(1, 3, 0.03)] * 3, 1.0)
    assert clock.plain_step_s(1) == pytest.approx(0.01)  # only the middle plain step counted
    _run(clock, [(1, 0, 0.01)], t)
    assert clock.overhead(1) == pytest.approx(2.0)  # only the middle round: 3 plain steps, model 1


def test_prefill_steps_and_stalls_are_not_samples():
    clock = RoundClock(lambda k: 1.0, ClockConfig(max_ratio=10.0, plain_samples=1))
    t = _run(clock, [(1, 0, 0.01)] * 4)
    clock.stepped(t, None)  # a step with prefill in it
    _run(clock, [(1, 0, 5.0), (1, 0, 0.01)], t + 0.01)
    assert clock.plain_step_s(1) == pytest.approx(0.01)
    t = _run(clock, [(1, 0, 0.01), (1, 0, 1.0), (1, 0, 0.01), (1, 0, 0.01)], 10.0)  # 100 plain steps: a stall
    assert clock.plain_step_s(1) == pytest.approx(0.01)


def test_a_bucket_asks_for_plain_steps_again_after_refresh_steps():
    clock = RoundClock(lambda k: 1.0, ClockConfig(refresh_steps=10, plain_samples=1))
    t = _run(clock, [(1, 0, 0.01)] * 3)
    assert not clock.needs_plain(1)
    _run(clock, [(1, 2, 0.02)] * 10, t)
    assert clock.needs_plain(1)


@pytest.mark.parametrize("kwargs, words", [({"decay": 1.0}, "decay"), ({"refresh_steps": 0}, "refresh_steps"),
                                           ({"max_ratio": 1.0}, "max_ratio"), ({"plain_samples": 0}, "plain_samples"),
                                           ({"probe_wait": 0}, "probe_wait"),
                                           ({"probe_wait": 100, "probe_wait_max": 50}, "probe_wait"),
                                           ({"probe_rounds": 2}, "probe_rounds"),
                                           ({"probe_share": 0.0}, "probe_share"),
                                           ({"off_below": 1.5}, "off_below")])
def test_clock_config_is_validated(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ClockConfig(**kwargs)


def _gated(clock: RoundClock, batch: int, steps: int, plain_s: float, round_s: float, tokens: float,
           t: float = 0.0) -> tuple[list[bool], float]:
    """The engine's loop as the gate sees it: each step drafts unless the clock wants a plain
    step timed or the gate says rounds do not pay; a round takes round_s and gives each row
    `tokens`, a plain step plain_s. Returns which steps were rounds, and the time after."""
    kinds = []
    for _ in range(steps):
        rounds = not clock.needs_plain(batch) and clock.pays(batch)
        clock.stepped(t, StepKind(batch, 4, tokens) if rounds else StepKind(batch, 0))
        t += round_s if rounds else plain_s
        kinds.append(rounds)
    return kinds, t


def test_the_gate_keeps_rounds_that_pay():
    clock = RoundClock(None, gate=True)
    kinds, _ = _gated(clock, 8, 200, plain_s=0.01, round_s=0.02, tokens=3.0)  # 1.5x plain
    assert clock.speedup(8) == pytest.approx(1.5)
    assert all(kinds[5:]) and not any(kinds[:5])  # five plain steps (three samples) time plain decoding first
    assert clock.overhead(8) == 0.0  # (no model given: no overhead kept)


def test_the_gate_turns_rounds_off_where_they_do_not_pay_and_probes_with_growing_waits():
    cfg = ClockConfig(probe_wait=10, probe_wait_max=40, probe_rounds=4, probe_share=1.0)
    clock = RoundClock(None, cfg, gate=True)
    kinds, t = _gated(clock, 128, 400, plain_s=0.01, round_s=0.04, tokens=2.0)  # 0.5x plain
    assert clock.speedup(128) == pytest.approx(0.5)
    starts = [i for i in range(1, len(kinds)) if kinds[i] and not kinds[i - 1]]
    runs = [next((j for j in range(i, len(kinds)) if not kinds[j]), len(kinds)) - i for i in starts]
    waits = [b - (a + n) for a, n, b in zip(starts, runs, starts[1:])]
    assert runs[0] == 3 and all(n == 4 for n in runs[1:])  # measured once, then probes of probe_rounds
    assert waits[:3] == [10, 20, 40] and set(waits[3:]) == {40}  # doubling up to probe_wait_max
    assert sum(kinds) / len(kinds) < 0.15
    # acceptance rises: the next probe finds rounds paying and they stay on
    kinds, _ = _gated(clock, 128, 200, plain_s=0.01, round_s=0.04, tokens=6.0, t=t)
    assert clock.speedup(128) > 1.0 and all(kinds[-100:])


def test_holds_off_foretells_the_gate_without_changing_it():
    # the scheduler asks holds_off before it reserves a step's rounds; the gate itself is asked
    # after: holding off must mean the gate says no, and asking must change nothing
    cfg = ClockConfig(probe_wait=10, probe_wait_max=40, probe_rounds=4, probe_share=1.0)
    clock, t, held, gated_off = RoundClock(None, cfg, gate=True), 0.0, 0, 0
    for _ in range(300):
        rounds = not clock.needs_plain(128)
        if rounds:
            first, second = clock.holds_off(128), clock.holds_off(128)
            rounds = clock.pays(128)
            assert first == second and not (first and rounds)
            held, gated_off = held + first, gated_off + (not rounds)
        clock.stepped(t, StepKind(128, 4, 2.0) if rounds else StepKind(128, 0))
        t += 0.04 if rounds else 0.01  # rounds at 0.5x plain: the gate turns them off
    # all but the first step of each wait is foretold (the step that turns rounds off is not)
    assert gated_off > 100 and held >= gated_off - 10


def test_the_gate_decides_per_bucket():
    clock = RoundClock(None, ClockConfig(probe_wait=50), gate=True)
    t = 0.0
    for batch, round_s in ((1, 0.015), (64, 0.05)):
        _, t = _gated(clock, batch, 40, plain_s=0.01, round_s=round_s, tokens=3.0, t=t)
    assert clock.speedup(1) == pytest.approx(2.0) and clock.speedup(64) == pytest.approx(0.6)
    assert clock.pays(1) and not clock.pays(64) and not clock.pays(33)  # 33: bucket 64


def test_rounds_running_go_off_only_below_the_margin_and_come_back_at_one():
    cfg = ClockConfig(probe_wait=10, probe_wait_max=20, probe_rounds=4, probe_share=1.0, off_below=0.95,
                      plain_samples=1)
    clock = RoundClock(None, cfg, gate=True)
    kinds, t = _gated(clock, 8, 100, plain_s=0.01, round_s=0.031, tokens=3.0)  # 0.97x: kept on
    assert clock.speedup(8) == pytest.approx(3 * 0.01 / 0.031) and all(kinds[3:])
    kinds, t = _gated(clock, 8, 100, plain_s=0.01, round_s=0.04, tokens=3.0, t=t)  # 0.75x: off
    assert sum(kinds) < 40
    kinds, _ = _gated(clock, 8, 300, plain_s=0.01, round_s=0.031, tokens=3.0, t=t)  # 0.97x again: stays off
    assert clock.speedup(8) == pytest.approx(3 * 0.01 / 0.031, abs=0.01)
    assert sum(kinds[-100:]) <= 5 * cfg.probe_rounds  # probes only, one each 20 plain steps


def test_probes_of_dear_rounds_wait_long_enough_to_cost_a_share():
    # a round costs 5 plain steps and gives 2 tokens: a probe of 4 loses 12 plain steps, so
    # at a 5% share it waits 240 plain steps, not probe_wait's 10
    clock = RoundClock(None, ClockConfig(probe_wait=10, probe_rounds=4, probe_share=0.05, plain_samples=1), gate=True)
    kinds, _ = _gated(clock, 128, 800, plain_s=0.01, round_s=0.05, tokens=2.0)
    starts = [i for i in range(1, len(kinds)) if kinds[i] and not kinds[i - 1]]
    assert starts[1] - starts[0] - 3 == 240 and starts[2] - starts[1] - 4 == 480


def test_a_gate_alone_does_not_time_plain_steps_below_a_batch_whose_rounds_pay():
    # rounds pay at 8: the tail of a run (7 .. 1 rows left) goes on drafting without plain
    # steps timed first; above 8, or under the adaptive policy (its overhead needs them), not
    clock = RoundClock(None, gate=True)
    _gated(clock, 8, 20, plain_s=0.01, round_s=0.02, tokens=3.0)
    assert clock.speedup(8) == pytest.approx(1.5)
    assert not any(clock.needs_plain(b) for b in (1, 2, 3, 4, 5, 7)) and clock.needs_plain(9)
    adaptive = RoundClock(lambda k: 1.0, gate=True)
    _gated(adaptive, 8, 20, plain_s=0.01, round_s=0.02, tokens=3.0)
    assert adaptive.needs_plain(4)
    dear = RoundClock(None, gate=True)  # rounds that do not pay at 8 say nothing of 4
    _gated(dear, 8, 20, plain_s=0.01, round_s=0.05, tokens=3.0)
    assert dear.needs_plain(4)


def test_the_gates_state_is_exported_per_bucket():
    from infer.server.metrics import gate_metrics
    clock = RoundClock(None, ClockConfig(probe_wait=50), gate=True)
    t = 0.0
    for batch, round_s in ((2, 0.015), (64, 0.05)):
        _, t = _gated(clock, batch, 20, plain_s=0.01, round_s=round_s, tokens=3.0, t=t)
    assert clock.gate_state() == {2: (pytest.approx(2.0), True), 64: (pytest.approx(0.6), False)}
    families = {f.name: {s.labels["batch"]: s.value for s in f.samples} for f in gate_metrics(clock)}
    assert families["infer_spec_batch_speedup"] == {"2": pytest.approx(2.0), "64": pytest.approx(0.6)}
    assert families["infer_spec_batch_on"] == {"2": 1, "64": 0}


def test_the_gates_report_gives_each_buckets_times():
    clock = RoundClock(None, ClockConfig(probe_wait=50), gate=True)
    t, kinds = 0.0, {}
    for batch, round_s in ((2, 0.015), (64, 0.05)):
        kinds[batch], t = _gated(clock, batch, 20, plain_s=0.01, round_s=round_s, tokens=3.0, t=t)
    report = clock.report()
    assert list(report) == [2, 64]
    assert report[2] == {"plain_ms": pytest.approx(10.0), "round_ms": pytest.approx(15.0),
                         "round_tokens": pytest.approx(3.0), "speedup": pytest.approx(2.0), "rounds_on": True,
                         "waited": 0, "wait": 0, "plain_steps": 5, "round_steps": 15, "plain_samples": 3, "round_samples": 13}
    for batch in (2, 64):  # the steps of each kind run, and the timed ones (both neighbours of their kind)
        b = report[batch]
        assert (b["plain_steps"], b["round_steps"]) == (kinds[batch].count(False), kinds[batch].count(True))
        assert 0 < b["plain_samples"] < b["plain_steps"] and 0 < b["round_samples"] < b["round_steps"]
    assert report[64]["speedup"] == pytest.approx(0.6) and report[64]["rounds_on"] is False
    assert report[64]["wait"] >= 50 and 0 < report[64]["waited"] <= kinds[64].count(False)
