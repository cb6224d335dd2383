"""RoundClock: what a speculative round really costs, in plain decode steps, measured while
the engine runs.

The adaptive policy's cost model (c and v(K)) times the forward functions alone, once at
start. A round also costs host work those calls do not show: proposing, building the
verification's inputs, the host sync that reads the accepted tokens, and the overlap of host
and GPU that a plain step keeps and a round gives up. On a small or fast model that work can
outweigh everything the draft saves. The clock times whole engine steps (one step's start to
the next's) and keeps, per batch-size bucket (powers of two):

- a plain step's wall time (an average that follows drift), and
- a round's overhead: its measured time in plain steps less what the model predicts.

The policy adds the overhead to its verification cost. A bucket whose plain time is missing
or older than `refresh_steps` decode steps asks the runner for plain steps to measure it.

A step's interval is counted only between two steps of its own kind (plain, plain, plain or
round, round, round): an overlapped plain step's GPU time is paid by whichever step waits
for its tokens next, so the first plain step after a round looks cheap and the last one
before a round looks free; neither is a sample. Steps with prefill in them are not timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClockConfig:
    decay: float = 0.8  # an estimate's weight against each new interval
    refresh_steps: int = 256  # decode steps in a bucket before its plain time is measured again
    max_ratio: float = 50.0  # an interval this many times the bucket's plain step is a stall: dropped

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.refresh_steps < 1 or self.max_ratio <= 1.0:
            raise ValueError(f"need refresh_steps >= 1 and max_ratio > 1, got {self.refresh_steps}, {self.max_ratio}")


@dataclass(frozen=True, slots=True)
class StepKind:
    batch: int  # decode rows
    k: int  # the step's longest draft; 0: a plain step


@dataclass(slots=True)
class _Bucket:
    plain_s: float | None = None  # seconds a plain step
    overhead: float | None = None  # plain steps a round costs beyond the model
    since_plain: int = 0  # decode steps since plain_s was last sampled


def bucket(batch: int) -> int:
    """The batch-size bucket: the smallest power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


class RoundClock:
    """Plain step times and round overheads per batch bucket, from step start times."""

    def __init__(self, model_cost: Callable[[int], float], config: ClockConfig | None = None) -> None:
        self.model_cost = model_cost  # a round of longest draft k, in plain steps, by the policy's model
        self.config = config or ClockConfig()
        self._buckets: dict[int, _Bucket] = {}
        self._recent: list[tuple[float, StepKind | None]] = []  # the last two steps: (start, kind)

    def needs_plain(self, batch: int) -> bool:
        """Whether the bucket's plain step time is missing or due for a refresh."""
        b = self._buckets.get(bucket(batch))
        return b is None or b.plain_s is None or b.since_plain >= self.config.refresh_steps

    def overhead(self, batch: int) -> float:
        """Plain steps a round at this batch size costs beyond the model (0 until measured)."""
        b = self._buckets.get(bucket(batch))
        return 0.0 if b is None or b.overhead is None else b.overhead

    def plain_step_s(self, batch: int) -> float | None:
        b = self._buckets.get(bucket(batch))
        return None if b is None else b.plain_s

    def stepped(self, start: float, kind: StepKind | None) -> None:
        """A step that started at `start` (seconds) ran; kind None: not a pure decode step.
        The step before it is a sample when the steps on both its sides are of its kind."""
        if kind is not None:
            self._buckets.setdefault(bucket(kind.batch), _Bucket()).since_plain += 1
        self._recent.append((start, kind))
        if len(self._recent) < 3:
            return
        (_, before), (t0, mid), (t1, after) = self._recent[-3:]
        del self._recent[0]
        if before is None or mid is None or after is None:
            return
        plain = mid.k == 0
        if (before.k == 0) == plain == (after.k == 0):
            self._sample(mid, t1 - t0)

    def _sample(self, kind: StepKind, seconds: float) -> None:
        b = self._buckets.setdefault(bucket(kind.batch), _Bucket())
        d = self.config.decay
        if b.plain_s is not None and seconds > self.config.max_ratio * b.plain_s:
            return  # a stall (a collection, the host busy elsewhere), not the step's cost
        if kind.k == 0:
            b.plain_s = seconds if b.plain_s is None else d * b.plain_s + (1 - d) * seconds
            b.since_plain = 0
        elif b.plain_s is not None:
            extra = seconds / b.plain_s - self.model_cost(kind.k)
            b.overhead = extra if b.overhead is None else d * b.overhead + (1 - d) * extra
