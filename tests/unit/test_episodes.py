"""Speculative episodes and the gain calibration (spec/episodes.py): pure, no model."""

from __future__ import annotations

import pytest

from infer.spec.episodes import Episode, GainCalibration

KEY = (1, True)


def test_an_episode_counts_its_steps_and_measures_them_in_plain_steps():
    e = Episode(batch_size=2, sampled=True, gain=1.5)
    assert e.outcome(0.001) is None  # no step yet: nothing to tell
    e.add(0.003, 5)
    e.add(0.001, 2)
    assert (e.steps, e.tokens) == (2, 7)
    plain_steps, realized, predicted = e.outcome(0.001)
    assert plain_steps == pytest.approx(4.0)
    assert realized == pytest.approx(3.5)  # tokens per request
    assert predicted == pytest.approx(6.0)  # the gain over that time
    assert e.outcome(None) is None and e.outcome(0.0) is None  # no plain baseline


def test_an_episode_is_losing_while_it_emitted_fewer_tokens_than_plain_steps_of_time():
    e = Episode(batch_size=4, sampled=False, gain=1.5)
    assert not e.losing(0.01)  # (no step yet: nothing to tell)
    e.add(0.03, 8)  # 3 plain steps of time, 2 tokens a request
    assert e.losing(0.01) and not e.losing(0.02)  # (at 0.02 s a plain step: 1.5 steps of time)
    e.add(0.01, 8)  # 4 plain steps of time, 4 tokens a request: even
    assert not e.losing(0.01)
    assert not e.losing(None)  # no plain baseline: nothing to tell
    e.add(0.01, 4, mixed=True)
    assert not e.losing(1e-6)  # prefill work in its time: nothing to tell


def test_kappa_starts_at_one_and_follows_episodes_that_fall_short():
    cal = GainCalibration()
    assert cal.factor(KEY) == 1.0
    for _ in range(20):
        cal.observe(KEY, plain_steps=3.0, realized=2.0, predicted=3.3)  # a lone round and its cold step
    assert cal.factor(KEY) == pytest.approx(2.0 / 3.3, rel=0.05)
    assert cal.factor((1, False)) == 1.0  # per mode
    assert cal.factor((2, True)) == 1.0  # and per bucket


def test_kappa_never_exceeds_one_nor_drops_below_its_floor():
    cal = GainCalibration(min_factor=0.4)
    cal.observe(KEY, 60.0, realized=200.0, predicted=100.0)
    assert cal.factor(KEY) == 1.0  # better than predicted: priced as measured
    for _ in range(200):  # (the good episode decays away)
        cal.observe(KEY, 2.0, realized=0.1, predicted=2.0)
    assert cal.factor(KEY) == pytest.approx(0.4)


def test_a_long_good_episode_outweighs_earlier_short_bad_ones():
    cal = GainCalibration()
    for _ in range(5):
        cal.observe(KEY, 1.2, realized=1.0, predicted=2.0)  # misses
    low = cal.factor(KEY)
    assert low < 0.8
    cal.observe(KEY, 70.0, realized=220.0, predicted=100.0)
    assert cal.factor(KEY) == 1.0 > low


def test_empty_or_free_episodes_change_nothing():
    cal = GainCalibration()
    cal.observe(KEY, 0.0, realized=0.0, predicted=0.0)
    cal.observe(KEY, 2.0, realized=1.0, predicted=0.0)
    assert cal._sums == {}


@pytest.mark.parametrize("kwargs, match", [({"prior_tokens": 0}, "prior_tokens"), ({"decay": 0.0}, "decay"),
                                           ({"decay": 1.5}, "decay"), ({"min_factor": 0.0}, "min_factor"),
                                           ({"half_life": 0.0}, "half_life")])
def test_calibration_validates_its_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GainCalibration(**kwargs)


def test_an_episode_beside_prefill_work_tells_nothing():
    e = Episode(batch_size=1, sampled=False, gain=2.0)
    e.add(0.002, 3)
    assert e.outcome(0.001) is not None
    e.add(0.002, 3, mixed=True)  # a step beside prefill chunks taints it for good
    e.add(0.002, 3)
    assert e.outcome(0.001) is None


def test_evidence_relaxes_toward_the_prior_so_a_locked_out_mode_is_tried_again():
    cal = GainCalibration(half_life=100.0)
    for _ in range(30):
        cal.observe(KEY, 3.0, realized=1.0, predicted=3.0)
    low = cal.factor(KEY)
    assert low < 0.4
    cal.relax(KEY, 1000)  # starts the clock: nothing moves yet
    assert cal.factor(KEY) == low
    cal.relax(KEY, 1100)  # one half-life: halfway back in weight
    assert low < cal.factor(KEY) < 1.0
    cal.relax(KEY, 3100)  # twenty more: back at the prior
    assert cal.factor(KEY) == pytest.approx(1.0, abs=1e-3)
    cal.relax((2, False), 5)  # a key without evidence: nothing to relax
    assert (2, False) not in cal._sums


def test_rate_is_what_episodes_realized_per_plain_step_once_there_is_enough_of_it():
    cal = GainCalibration(decay=1.0, min_rate_steps=8.0)
    assert cal.rate(KEY) is None  # never tried
    cal.observe(KEY, 4.0, realized=6.0, predicted=8.0)
    assert cal.rate(KEY) is None  # 4 plain steps of evidence: too little to tell
    cal.observe(KEY, 6.0, realized=6.0, predicted=8.0)
    assert cal.rate(KEY) == pytest.approx(12.0 / 10.0)  # tokens per request per plain step
    assert cal.rate((2, False)) is None  # per key


def test_rate_evidence_fades_to_nothing_so_an_untried_mode_is_unknown_again():
    cal = GainCalibration(half_life=100.0, min_rate_steps=8.0)
    for _ in range(10):
        cal.observe(KEY, 3.0, realized=3.0, predicted=6.0)
    assert cal.rate(KEY) == pytest.approx(1.0)
    cal.relax(KEY, 0)
    cal.relax(KEY, 100)  # one half-life: the same rate on less evidence
    assert cal.rate(KEY) == pytest.approx(1.0)
    cal.relax(KEY, 1000)  # too little left to tell
    assert cal.rate(KEY) is None


def test_min_rate_steps_is_validated():
    with pytest.raises(ValueError, match="min_rate_steps"):
        GainCalibration(min_rate_steps=0.0)


def test_an_episode_is_extended_by_the_time_its_steps_held_the_loop():
    e = Episode(batch_size=2, sampled=False, gain=2.0)
    e.add(0.002, 6)
    e.extend(0.001)  # retiring it and scheduling the next step
    assert e.seconds == pytest.approx(0.003) and e.tokens == 6 and e.steps == 1
    assert e.outcome(0.001) == pytest.approx((3.0, 3.0, 6.0))
