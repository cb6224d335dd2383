"""A stretch of plain decode steps run through the plain runner's own methods.

While the adaptive policy's all-plain decision stands (`AdaptivePolicy.quiet`), every step
of a speculative runner is a plain decode step, yet each still passed through the
speculative runner's overrides: the scheduler's reservation (`decode_demand`,
`ensure_capacity`), the decode wrapper (`quiet`, the plain-step timer). On a small target
those cost a few % of a step (H100, demo pair: ~10 us of a 0.46 ms step), the margin the
adaptive policy is allowed to lose against plain decoding.

`PlainStretch.enter(n)` makes the runner's class, for the next n steps (the steps the
decision is known to hold), a subclass of its own whose `decode_demand`, `ensure_capacity`
and `_decode` are the plain ContinuousRunner's, and `leave` gives the runner its own class
back. The only per-step work left is a countdown in `_in_flight`, the hook plain decoding
calls anyway, and the runner's `each_step` there if it has one (shadow drafts, taken and
checked under the forward; it may end the stretch), and its `after_step` after the step's
tokens are read, if it has one (a wrapper around the plain `_decode`: for what must be known
before the next step is decided; it may end the stretch too).

With `on_timed`, one step in every `time_every` (never the stretch's first, which follows
a round or a choice) is timed and reported: the plain step the adaptive policy should weigh
rounds against is a stretch step, not the boundary steps around stretches and rounds,
which the runner times otherwise (H100, n-gram at W5 T=1: 0.66 against 0.56 ms, and rounds
looked that much cheaper).

Without `after_step`, a stretch's steps are *bare*: the runner's class then has the plain
runner's `step` and `_decode` as well, so the step runs exactly the plain runner's code
but for the countdown. Only a stretch's first step, each timed step and the step after it
run the runner's own `step` (which files the time between a measured step and the next)
and the timing wrapper: the class changes for them in the countdown before. (Until the
twenty-fourth pass every stretch step ran the runner's `step` and the wrapper: ~35 calls
a step more than plain decoding on the dev CPU.)

The stretch ends when its steps are done, or early when the batch changes (`allocate`, or
a `release` the decision does not survive: `AdaptivePolicy.keep_quiet_without`), and
`leave` reports how many steps ran so the policy's step clock can catch up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.engine.request import Request
    from infer.engine.runner import ContinuousRunner

# the runner methods a stretch replaces with the plain runner's
PLAIN_METHODS = ("decode_demand", "ensure_capacity", "_decode")
# ... and those a bare stretch step (no `after_step`, not timed) takes from it too
BARE_METHODS = ("step", "_decode")


class PlainStretch:
    """Plain decode steps through the plain runner's methods (see the module docstring)."""

    def __init__(self, runner: ContinuousRunner, plain_class: type, on_leave: Callable[[int], None],
                 each_step: Callable[[Sequence[Request]], bool] | None = None,
                 after_step: Callable[[Sequence[Request]], bool] | None = None,
                 on_timed: Callable[[Sequence[Request], float], None] | None = None, time_every: int = 16) -> None:
        if time_every < 2:
            raise ValueError(f"time_every must be >= 2 (a stretch's first step is never timed), got {time_every}")
        self.runner = runner
        self.plain_class = plain_class
        self.on_leave = on_leave  # called with the number of steps the stretch ran
        # called in each step's `_in_flight` (the forward queued, its tokens not yet read);
        # True ends the stretch after that step
        self.each_step = each_step
        # called after each step's tokens are read (on the critical path: keep it cheap);
        # True ends the stretch there
        self.after_step = after_step
        # called with (requests, seconds of the plain `_decode`) for one step in every
        # `time_every` of a stretch: the plain steps' cost
        self.on_timed = on_timed
        self.time_every = time_every
        self.left = 0  # steps still to run; 0: not in a stretch
        self.done = 0
        self.home: type | None = None  # the runner's own class while a stretch runs
        self.methods = PLAIN_METHODS  # the plain class's methods a stretch runs (A/B scripts may add some)
        self.bare_steps = True  # False: every step runs the runner's own `step`, as before bare steps
        self._classes: dict[tuple[type, str, tuple[str, ...]], type] = {}  # -> stretch class
        self._full: type | None = None  # this stretch's class for steps through the runner's `step`
        self._bare: type | None = None  # ... and for bare steps (None: it has none)
        self._each: Callable[[Sequence[Request]], bool] | None = None  # this stretch's `each_step`
        self._after: Callable[[Sequence[Request]], bool] | None = None  # ... and `after_step`

    @property
    def active(self) -> bool:
        return self.left > 0

    def enter(self, steps: int, hooks: bool = True) -> None:
        """Run the next `steps` decode steps (>= 1) as plain steps through the plain methods;
        without `hooks`, this stretch calls neither `each_step` nor `after_step`."""
        if steps < 1 or self.active:
            return
        self.left, self.done = steps, 0
        self._each = self.each_step if hooks else None
        after = self._after = self.after_step if hooks else None
        home = self.home = type(self.runner)
        wrapped = after is not None or self.on_timed is not None
        self._full = self._stretch_class(home, "wrapped" if wrapped else "plain")
        self._bare = (self._stretch_class(home, "bare")
                      if after is None and self.bare_steps and self.time_every > 2 else None)
        # (the first step runs the runner's `step`: it files the gap after the step before)
        self.runner.__class__ = self._full

    def _stretch_class(self, home: type, kind: str) -> type:
        """The runner's class during a stretch: `home` with the plain class's `methods`, and
        `_in_flight` counting the steps (`_count`); `_decode` through `_decode_step` for kind
        "wrapped", `step` and `_decode` the plain class's for "bare" (made once per key)."""
        key = (home, kind, self.methods)
        cls = self._classes.get(key)
        if cls is None:
            stretch = self

            def _in_flight(runner: object, requests: Sequence[Request]) -> None:
                stretch._count(requests)

            def _decode(runner: object, requests: Sequence[Request]) -> object:
                return stretch._decode_step(requests)

            names = (*self.methods, *BARE_METHODS) if kind == "bare" else self.methods
            namespace: dict[str, object] = {name: getattr(self.plain_class, name) for name in names}
            namespace.update(_in_flight=_in_flight, __module__=home.__module__)
            if kind == "wrapped":
                namespace["_decode"] = _decode
            cls = self._classes[key] = type(f"{home.__name__}InPlainStretch", (home,), namespace)
        return cls

    def _count(self, requests: Sequence[Request]) -> None:
        # `_in_flight` of each plain step of the stretch: the stretch's only per-step work
        self.done += 1
        self.left -= 1
        each_step = self._each
        if (each_step is not None and each_step(requests)) or not self.left:
            self.leave()
        elif self._bare is not None:
            # the next step is bare but for a timed one and the one after it (whose own
            # `step` files the gap after the timed one)
            phase = self.done % self.time_every
            if phase == 1:
                self.runner.__class__ = self._bare
            elif phase == self.time_every - 1 and self.on_timed is not None:
                self.runner.__class__ = self._full

    def _decode_step(self, requests: Sequence[Request]) -> object:
        # `_decode` of each step of the stretch when there is an `after_step` or `on_timed`
        # (run after the stretch's last step too, which left in its `_in_flight`)
        on_timed = self.on_timed
        if on_timed is not None and self.done % self.time_every == self.time_every - 1:  # (done: steps before)
            start = time.perf_counter()
            out = self.plain_class._decode(self.runner, requests)
            on_timed(requests, time.perf_counter() - start)
        else:
            out = self.plain_class._decode(self.runner, requests)
        after_step = self._after
        if after_step is not None and after_step(requests) and self.active:
            self.leave()
        return out

    def leave(self) -> None:
        """End the stretch (if any): the runner's own methods again; `on_leave(steps run)`."""
        if not self.active and not self.done:
            return
        if self.home is not None:
            self.runner.__class__ = self.home
            self.home = None
        done, self.left, self.done = self.done, 0, 0
        self.on_leave(done)
