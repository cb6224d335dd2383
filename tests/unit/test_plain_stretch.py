"""PlainStretch (engine/plain_stretch.py): the plain runner's methods for n steps (the
runner's class made a subclass of its own that has them), counted in `_in_flight`; an
`each_step` hook that may end the stretch; bare steps (the plain `step` too) but for the
first, the timed ones and the ones after them; `leave` restores the runner's class."""

from __future__ import annotations

import pytest

from infer.engine.plain_stretch import PLAIN_METHODS, PlainStretch


class _Plain:
    def step(self, requests):
        return self._decode(requests)

    def decode_demand(self, request):
        return "plain demand"

    def ensure_capacity(self, request, total):
        return "plain capacity"

    def _decode(self, requests):
        self._in_flight(requests)  # as the plain runner's decode step does
        return "plain decode"

    def _in_flight(self, requests):
        return None


class _Runner(_Plain):
    def __init__(self):
        self.steps = []  # which `step` ran each step: "own" or "plain"

    def step(self, requests):
        self.steps.append("own")
        return self._decode(requests)

    def decode_demand(self, request):
        return "own demand"

    def ensure_capacity(self, request, total):
        return "own capacity"

    def _decode(self, requests):
        return "own decode"


def _own(runner: _Runner) -> list:
    return [runner.decode_demand(None), runner.ensure_capacity(None, 1), runner._decode([])]


def test_a_stretch_runs_its_steps_then_gives_the_methods_back():
    runner, left = _Runner(), []
    stretch = PlainStretch(runner, _Plain, left.append)
    stretch.enter(3)
    assert stretch.active and _own(runner) == ["plain demand", "plain capacity", "plain decode"]
    assert type(runner) is not _Runner and isinstance(runner, _Runner)  # a class of the stretch's
    assert not any(name in vars(runner) for name in (*PLAIN_METHODS, "_in_flight"))  # (no instance attributes)
    runner._decode([])  # two more steps: the third `_decode` ends it
    assert stretch.active and not left
    runner._decode([])
    assert not stretch.active and left == [3]
    assert _own(runner) == ["own demand", "own capacity", "own decode"] and type(runner) is _Runner
    stretch.leave()  # nothing to end: no second report
    stretch.enter(0)  # no steps: no stretch
    assert left == [3] and not stretch.active


def test_each_step_sees_every_step_and_may_end_the_stretch():
    runner, left, seen = _Runner(), [], []
    verdicts = iter([False, False, True])
    stretch = PlainStretch(runner, _Plain, left.append, lambda requests: (seen.append(requests), next(verdicts))[1])
    stretch.enter(10)
    for i in range(3):
        runner._decode([i])
    assert seen == [[0], [1], [2]]
    assert not stretch.active and left == [3]  # ended after the step that said so, counted
    assert runner._decode([]) == "own decode"


def test_leaving_early_reports_the_steps_run():
    runner, left = _Runner(), []
    stretch = PlainStretch(runner, _Plain, left.append)
    stretch.enter(5)
    runner._decode([])
    stretch.leave()  # the batch changed
    assert left == [1] and not stretch.active and runner._decode([]) == "own decode"


def test_after_step_runs_once_each_step_is_decoded_and_may_end_the_stretch():
    # `after_step` sees each step's requests after its plain decode (the tokens read), the
    # last step's too; True ends the stretch there
    runner, left, order = _Runner(), [], []
    verdicts = iter([False, True, False, False, False])

    def each_step(requests):
        order.append("in flight")
        return False

    def after_step(requests):
        order.append("after")
        return next(verdicts)

    stretch = PlainStretch(runner, _Plain, left.append, each_step, after_step)
    stretch.enter(4)
    assert runner._decode([1]) == "plain decode" and stretch.active
    assert runner._decode([2]) == "plain decode"
    assert not stretch.active and left == [2]  # ended after its second step
    assert order == ["in flight", "after", "in flight", "after"]
    assert _own(runner) == ["own demand", "own capacity", "own decode"]
    stretch.enter(1)  # the last step leaves in its `_in_flight`; `after_step` still runs
    assert runner._decode([3]) == "plain decode"
    assert order[-2:] == ["in flight", "after"] and left == [2, 1] and not stretch.active


def test_one_step_in_time_every_is_timed_never_a_stretchs_first():
    # the plain baseline comes from stretch steps: one in `time_every`, its plain decode alone
    # (the first step of a stretch follows a round or a choice, and is never timed)
    runner, left, timed = _Runner(), [], []
    stretch = PlainStretch(runner, _Plain, left.append, on_timed=lambda requests, s: timed.append((requests, s)),
                           time_every=4)
    stretch.enter(10)
    for i in range(10):
        runner._decode([i])
    assert [r for r, _ in timed] == [[3], [7]] and all(s >= 0 for _, s in timed)
    assert left == [10] and not stretch.active
    stretch.enter(3)  # a stretch shorter than `time_every`: none timed
    for i in range(3):
        runner._decode([i])
    assert len(timed) == 2 and left == [10, 3]
    with pytest.raises(ValueError, match="time_every"):
        PlainStretch(runner, _Plain, left.append, time_every=1)


class _Counted(_Runner):
    """A runner whose plain `step` is told apart from its own."""


def _plain_step(self, requests):
    self.steps.append("plain")
    return self._decode(requests)


_CountedPlain = type("_CountedPlain", (_Plain,), {"step": _plain_step})


def test_bare_steps_run_the_plain_step_but_the_first_and_each_timed_one_and_the_next():
    # a stretch without `after_step` runs the plain class's `step` too, except at its first
    # step, each timed step and the step after it (the runner's own `step` files the time
    # after a measured step)
    runner, left, timed = _Counted(), [], []
    stretch = PlainStretch(runner, _CountedPlain, left.append, on_timed=lambda requests, s: timed.append(requests),
                           time_every=4)
    stretch.enter(10)
    for i in range(10):
        assert runner.step([i]) == "plain decode"
    assert runner.steps == ["own", "plain", "plain", "own", "own", "plain", "plain", "own", "own", "plain"]
    assert timed == [[3], [7]] and left == [10] and type(runner) is _Counted
    runner.steps.clear()
    stretch.bare_steps = False  # (the A/B scripts' switch) every step through the runner's own `step`
    stretch.enter(3)
    for i in range(3):
        runner.step([i])
    assert runner.steps == ["own"] * 3 and left == [10, 3]


def test_a_stretch_with_after_step_has_no_bare_steps_unless_entered_without_hooks():
    runner, left, seen = _Counted(), [], []
    stretch = PlainStretch(runner, _CountedPlain, left.append, lambda requests: seen.append(("each", requests)),
                           lambda requests: seen.append(("after", requests)), time_every=4)
    stretch.enter(3)
    for i in range(3):
        runner.step([i])
    assert runner.steps == ["own"] * 3 and len(seen) == 6
    runner.steps.clear()
    stretch.enter(3, hooks=False)  # (a stretch without shadows: no hooks, bare steps)
    for i in range(3):
        runner.step([i])
    assert runner.steps == ["own", "plain", "plain"] and len(seen) == 6 and left == [3, 3]
