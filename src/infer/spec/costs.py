"""Step costs for the adaptive speculation policy (spec/policy.py): what a decode step with
K drafts costs relative to a plain decode step, per batch-size bucket.

Calibration at start-up (engine/calibration.py) times forwards alone; the speculative
runner then reports the wall time of real steps and of drafting, and those replace the
calibration. A K not measured yet is priced from its nearest measured neighbour: the extra
draft steps (their measured slope, else calibrated) and the calibrated difference in
verification width, scaled to the real plain step. The round's own host overhead is in the
measured neighbour, so it counts once per round.

Costs are kept per sampling mode as well: a batch in which some request samples at a
temperature > 0 (`batch_samples`) pays for sampling in its plain steps and verifies by
rejection sampling (draft probabilities, uniforms) in its rounds. On the H100 demo pair a
plain step costs ~100 us more at T=1 than at T=0 and a draft-model round of K=5 ~0.6 ms
more, so a ratio taken across modes is wrong both ways (T=0 requests after T=1 ones saw
rounds priced out; the reverse, rounds priced cheap).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def request_samples(request: object) -> bool:
    """Whether a request samples at a temperature > 0 (requests without sampling
    parameters, as in unit tests, count as greedy)."""
    params = getattr(request, "sampling_params", None)
    return params is not None and not params.greedy


def batch_samples(requests: Sequence[object]) -> bool:
    """A batch's sampling mode for costs: whether any of its requests samples."""
    return any(request_samples(r) for r in requests)


@dataclass
class CostModel:
    """Step costs relative to a plain decode step, per batch-size bucket and sampling mode
    (`sampled`: whether the batch samples, `batch_samples`).

    Calibration (start-up, forward passes only) gives c and v(K) (relative to a plain
    forward) and the forward's seconds; the runner then reports the measured wall time of
    steps (`observe`), host overhead included, and of drafting (`observe_draft`), and
    measured costs replace the calibrated ones as they arrive. So a setup where per-step
    overhead dominates (tiny models) learns that speculating does not pay. Each cost is the lower
    median of its last `window` measurements, and counts only from its second measurement
    on: the first step of a kind pays one-off costs (kernel compilation, graph uploads,
    first allocations, a garbage collection) that must not make speculation look hopeless
    for good. For the same reason a cost expires `max_age` measured steps after its latest
    measurement: a K measured only while slow would otherwise never be chosen again, nor
    re-measured, and a plain step measured only at start-up would misprice everything. An
    expired cost is predicted again (the policy re-measures a plain step before it decides
    anything, and probes soon while no round's cost is fresh, `has_round`); its new window
    counts from its first measurement (the one-off costs were the old window's), though
    alone that measurement counts only up to the value the cost expired at: one slow round
    right after expiry (H100, W5 T=0, run 21f: a 5 ms round, 11.7 plain steps) would
    otherwise price speculation out until the cost expires again, and a round not taken is
    never measured; a real rise shows at the second measurement.
    """

    k_max: int
    draft_ratio: dict[int, float] = field(default_factory=dict)  # bucket -> c
    verify_ratio: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [v(0..k_max)]
    forward_seconds: dict[int, float] = field(default_factory=dict)  # bucket -> calibrated plain forward
    window: int = 8
    max_age: int = 256  # measured steps (`observe` calls) a cost stays valid after its latest measurement
    _clock: int = 0  # `observe` calls so far
    _latest: dict[tuple[str, object], int] = field(default_factory=dict, repr=False)  # key -> _clock of its last sample
    _samples: dict[tuple[str, object], deque[float]] = field(default_factory=dict, repr=False)
    _sizes: dict[tuple[str, object], deque[int]] = field(default_factory=dict, repr=False)  # each sample's batch size
    _values: dict[tuple[str, object], float] = field(default_factory=dict, repr=False)
    _dirty: set[tuple[str, object]] = field(default_factory=set, repr=False)
    # keys measured again after expiring -> the value each expired at (inf: none): the new
    # window's first sample counts alone, but only up to it (a real rise shows at the
    # second sample, an outlier alone prices nothing out)
    _renewed: dict[tuple[str, object], float] = field(default_factory=dict, repr=False)
    version: int = 0  # bumped by every measurement of a speculative step or a switch
    plain_version: int = 0  # bumped by every measurement of a plain step

    @staticmethod
    def bucket(batch_size: int) -> int:
        """The power of two at or above batch_size (1 for 1)."""
        return 1 << max(0, batch_size - 1).bit_length()

    def _record(self, key: tuple[str, object], seconds: float, batch_size: int) -> None:
        samples = self._samples.get(key)
        if samples is None or not self._fresh(key):  # expired samples go: a new window starts
            if samples is not None:  # one-off costs are behind: its first sample counts
                expired = self._value(key, expired=True)
                self._renewed[key] = math.inf if expired is None else expired
            samples = self._samples[key] = deque(maxlen=self.window)
            self._sizes[key] = deque(maxlen=self.window)
            self._values.pop(key, None)
        samples.append(seconds)
        self._sizes[key].append(batch_size)
        self._dirty.add(key)
        self._latest[key] = self._clock

    def _fresh(self, key: tuple[str, object]) -> bool:
        return self._clock - self._latest.get(key, -self.max_age - 1) <= self.max_age

    def _value(self, key: tuple[str, object], expired: bool = False) -> float | None:
        """Lower median of the key's measurements; None before its second one (its first
        one after it expired counts alone), and once expired unless `expired`."""
        if not expired and not self._fresh(key):
            return None
        if key in self._dirty:
            self._dirty.discard(key)
            samples = self._samples[key]
            if len(samples) >= (1 if key in self._renewed else 2):
                value = sorted(samples)[(len(samples) - 1) // 2]
                self._values[key] = min(value, self._renewed[key]) if len(samples) == 1 else value
        return self._values.get(key)

    def observe(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        """Wall time of a step whose longest draft had k tokens (switching costs excluded)."""
        self._clock += 1
        self._record(("step", (self.bucket(batch_size), k, sampled)), seconds, batch_size)
        if k:
            self.version += 1
        else:
            self.plain_version += 1

    def extend_latest(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        """Add `seconds` to the latest `observe`d step of this kind (the time it held the loop
        beyond its own measurement, known only once the next step starts)."""
        key = ("step", (self.bucket(batch_size), k, sampled))
        samples = self._samples.get(key)
        if samples and seconds:
            samples[-1] += seconds
            self._dirty.add(key)

    def observe_switch(self, batch_size: int, seconds: float, units: float = 1.0, sampled: bool = False) -> None:
        """Wall time a step spent switching from plain decoding back to speculation: catching
        up on `units` units of work (a draft model: chunks of skipped tokens)."""
        self._record(("switch", (self.bucket(batch_size), sampled)), seconds / max(units, 1.0), batch_size)
        self.version += 1

    def observe_upkeep(self, batch_size: int, seconds: float, sampled: bool = False) -> None:
        """Wall time a plain step spent on shadow drafts and the proposer's table upkeep (the
        mean over a plain stretch): what keeping speculation possible costs while decoding
        plainly."""
        self._record(("upkeep", (self.bucket(batch_size), sampled)), seconds, batch_size)

    def upkeep(self, batch_size: int, sampled: bool = False) -> float:
        """The upkeep a plain step pays, relative to a plain step (0 while unknown). Kept once
        measured, expired or not: where it priced shadows out, none run to measure it again."""
        plain = self.step_seconds(batch_size, 0, sampled)
        seen = self._value(("upkeep", (self.bucket(batch_size), sampled)), expired=True)
        return seen / plain if seen is not None and plain else 0.0

    def step_seconds(self, batch_size: int, k: int, sampled: bool = False) -> float | None:
        """The measured wall time of a step with k drafts at this batch size, if known: for
        a plain step (k = 0) at this very batch size (`plain_at`), for a round its bucket's."""
        if not k:
            return self.plain_at(batch_size, sampled)
        return self._value(("step", (self.bucket(batch_size), k, sampled)))

    def plain_at(self, batch_size: int, sampled: bool = False, expired: bool = False) -> float | None:
        """A plain step's seconds at this batch size: its bucket's measured cost (lower
        median) taken as the cost at the bucket's median measured batch size, and moved
        from there along the line to the adjacent bucket's on batch_size's side, kept
        between flat and proportional to the batch size (a step has a fixed part and a
        part per request, neither negative); flat where no bucket on that side is measured
        (never extrapolated: a plain step priced too high makes rounds look cheap, and
        extrapolating the full batch's step from the line below its bucket did so on the
        H100 at W2 T=1, run 19d). None while the bucket has none.

        Why: a bucket spans batch sizes whose plain steps differ by up to 2x where the host
        work per request dominates (the demo target at W2 on the H100: ~1.1 ms at 16, ~2 ms
        at 32). Its plain steps are measured mostly at the top, when the batch is full, its
        rounds later as requests finish: priced against the full batch's plain step, rounds
        at batch 17-24 looked ~30 % cheaper than they were, and so did their episodes
        (kappa stayed at 1 while n-gram rounds above batch 16 lost 5-10 % of W2 T=0, H100
        runs 18c and 19c)."""
        b = self.bucket(batch_size)
        key = ("step", (b, 0, sampled))
        own = self._value(key, expired)
        if own is None:
            return None
        n = self._median_size(key)
        if batch_size == n:
            return own
        near = ("step", (b // 2 if batch_size < n else b * 2, 0, sampled))
        seconds = self._value(near, expired) if near in self._samples else None
        if seconds is None:
            return own
        n2 = self._median_size(near)
        guess = own + (own - seconds) / (n - n2) * (batch_size - n)
        proportional = own * batch_size / n
        return min(max(guess, min(own, proportional)), max(own, proportional))

    def _median_size(self, key: tuple[str, object]) -> int:
        sizes = sorted(self._sizes[key])
        return sizes[(len(sizes) - 1) // 2]

    def _round_ratio(self, bucket: int, k: int, sampled: bool, expired: bool = False) -> float | None:
        """r(k) measured at this bucket: the lower median of its rounds' seconds, each over
        a plain step at the round's own batch size (`plain_at`); None while not measured
        (twice; and fresh unless `expired`)."""
        key = ("step", (bucket, k, sampled))
        if self._value(key, expired) is None:
            return None
        ratios = sorted(t / plain for t, n in zip(self._samples[key], self._sizes[key], strict=True)
                        if (plain := self.plain_at(n, sampled, expired=True)))
        return ratios[(len(ratios) - 1) // 2] if ratios else None

    @property
    def observed(self) -> dict[tuple[int, int, bool], float]:
        """(bucket, k, sampled) -> measured step seconds, for the keys measured at least twice."""
        out = {}
        for tag, key in list(self._samples):
            if tag == "step" and (value := self._value((tag, key))) is not None:
                out[key] = value
        return out

    def observe_draft(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        """Wall time the proposer spent drafting a round whose longest draft had k tokens
        (catch-up excluded), sampling, host work and the final sync included."""
        if k:
            self._record(("draft", (self.bucket(batch_size), k, sampled)), seconds, batch_size)
            self.version += 1

    def switch_cost(self, batch_size: int, sampled: bool = False) -> float:
        """Switching cost per unit of catch-up work relative to a plain step: measured, else
        two draft steps' worth."""
        plain = self.step_seconds(batch_size, 0, sampled)
        seen = self._value(("switch", (self.bucket(batch_size), sampled)))
        if seen is not None and plain:
            return seen / plain
        return 2.0 * self.draft_step(batch_size, sampled)

    def draft_step(self, batch_size: int, sampled: bool = False) -> float:
        """One more draft token's cost relative to a plain step. Measured: the slope of the
        drafting time between the shortest and the longest drafts measured (a round's drafting
        has a fixed part, its first feed and the final sync, so one length alone cannot tell);
        else calibrated (c, scaled from the calibrated forward to the real plain step)."""
        plain = self.step_seconds(batch_size, 0, sampled)
        b = self.bucket(batch_size)
        measured = {k: t for k in range(1, self.k_max + 1)
                    if (t := self._value(("draft", (b, k, sampled)))) is not None}
        if plain and len(measured) >= 2:
            lo, hi = min(measured), max(measured)
            return max(0.0, measured[hi] - measured[lo]) / (hi - lo) / plain
        return self.calibrated(batch_size)[0] * self._forward_share(batch_size, plain)

    def _forward_share(self, batch_size: int, plain: float | None) -> float:
        """The calibrated plain forward's share of a real plain step (1 when either is unknown):
        calibration times forwards alone, a real step adds sampling, a host sync and output."""
        forward = self.forward_seconds.get(self._calibrated_bucket(batch_size))
        return min(1.0, forward / plain) if plain and forward is not None else 1.0

    def has_plain(self, batch_size: int, sampled: bool = False) -> bool:
        """Whether a plain step's cost is known at this batch size (measured twice, not expired)."""
        return self.step_seconds(batch_size, 0, sampled) is not None

    def has_round(self, batch_size: int, sampled: bool = False) -> bool:
        """Whether some round's cost is known at this batch size (measured twice, not expired).
        If not, its costs are a guess: calibration, or measurements too old to trust (the
        first rounds after start-up can be slow, and would otherwise stand for good)."""
        return any(self.step_seconds(batch_size, k, sampled) is not None for k in range(1, self.k_max + 1))

    def _neighbour_rounds(self, batch_size: int, sampled: bool) -> dict[int, float]:
        """K -> r(K) measured (expired or not) at the nearest other bucket of this sampling
        mode with a round and a plain step measured (ties: the larger, where rounds cost
        relatively more); empty if there is none. Calibration times forwards alone, and a
        round's host overhead, which it misses, is most of a round at small batches and
        changes slowly with the batch size: on the H100 demo pair (draft model, T=1) rounds
        at batch 2-4 were priced 1.1-1.6 plain steps by calibration and took 4-7, as they
        did at 8 (3.9, measured), run 18m."""
        b = self.bucket(batch_size)
        measured = {key[0] for tag, key in list(self._samples)
                    if tag == "step" and key[2] == sampled and key[0] != b and key[1]
                    and self._value((tag, key), expired=True) is not None
                    and self._value(("step", (key[0], 0, sampled)), expired=True) is not None}
        if not measured:
            return {}
        near = min(measured, key=lambda x: (abs(x.bit_length() - b.bit_length()), -x))
        return {k: r for k in range(1, self.k_max + 1)
                if (r := self._round_ratio(near, k, sampled, expired=True)) is not None}

    def _calibrated_bucket(self, batch_size: int) -> int | None:
        """The calibrated batch size nearest batch_size's bucket (ties: the smaller); None
        before calibration."""
        b = self.bucket(batch_size)
        return min(sorted(self.verify_ratio), key=lambda x: abs(x - b), default=None)

    def calibrated(self, batch_size: int) -> tuple[float, list[float]]:
        """(c, [v(0..k_max)]) of the nearest calibrated batch size (defaults before calibration)."""
        near = self._calibrated_bucket(batch_size)
        return self.draft_ratio.get(near, 0.5), self.verify_ratio.get(near, [1.0] * (self.k_max + 1))

    def relative_costs(self, batch_size: int, sampled: bool = False) -> list[float]:
        """r(K) = step time with K drafts / plain step time, K = 0..k_max (r(0) = 1).

        Measured K are taken as measured. An unseen K is the nearest measured K > 0 (plain
        decoding, K = 0, if none) plus the difference: (K - K') draft steps (`draft_step`)
        and the calibrated difference in verification width. A round's own overhead (the
        host work of proposing, verifying and accepting) is in the measured neighbour and
        is paid once per round, not once per draft token. While no round's cost is fresh,
        expired ones still stand (a calibration of forwards alone would underprice them),
        and where none was ever measured, the nearest bucket's measured rounds stand in
        (`_neighbour_rounds`), as relative costs."""
        c, v = self.calibrated(batch_size)
        plain = self.step_seconds(batch_size, 0, sampled)
        if not plain:
            return [1.0] + [k * c + v[k] for k in range(1, self.k_max + 1)]
        d, w = self.draft_step(batch_size, sampled), self._forward_share(batch_size, plain)
        b = self.bucket(batch_size)
        seen = {0: 1.0}
        for k in range(1, self.k_max + 1):
            if (r := self._round_ratio(b, k, sampled)) is not None:
                seen[k] = r
        if len(seen) == 1:  # no round measured lately: an expired measurement beats calibration
            for k in range(1, self.k_max + 1):
                if (r := self._round_ratio(b, k, sampled, expired=True)) is not None:
                    seen[k] = r
        if len(seen) == 1:  # never measured here: a measured neighbour beats calibration
            seen.update(self._neighbour_rounds(batch_size, sampled))
        bases = [x for x in seen if x] or [0]  # a measured round includes a round's overhead
        costs = [1.0]
        for k in range(1, self.k_max + 1):
            if k in seen:
                costs.append(seen[k])
                continue
            near = min(bases, key=lambda x: (abs(x - k), x))
            guess = seen[near] + (k - near) * d + (v[k] - v[near]) * w
            # never below a measured shorter round, nor above a measured longer one
            low = max(seen[x] for x in seen if x < k)
            high = min((seen[x] for x in seen if x > k), default=guess)
            costs.append(min(max(guess, low), max(high, low)))
        return costs
