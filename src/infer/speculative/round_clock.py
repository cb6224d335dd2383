"""RoundClock: what a speculative round really costs, in plain decode steps, measured while
the engine runs.

The cost model (c and v(K)) times the forward functions alone; a round also costs host work
(proposing, building the verification, the host sync) and gives up the overlap a plain step
keeps. The clock times whole engine steps and keeps, per batch-size bucket (`bucket`), a
plain step's wall time and a round's overhead beyond the model, which the policy adds to
its verification cost. A bucket without a recent plain time asks for plain steps
(`refresh_steps`). Only intervals between two steps of one kind count; steps with prefill
are not timed. Why: docs/speculation.md, "The round clock".
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
