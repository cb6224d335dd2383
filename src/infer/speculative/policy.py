"""Speculation length policies: how many tokens K each request drafts in a round.

`FixedPolicy` (K = `spec_length`, the default); `AdaptivePolicy` (K per request by the walltime factor, Leviathan et
al. 2023 Theorem 3.8, with probes while plain); `RoundClock` (plain step and round times per batch bucket: the round
overhead and the batch gate, `pays`); `ShadowRounds` (free drafts scored while their request decodes plainly).
docs/speculation.md: "The length policy", "The round clock", "The batch gate", "Shadow rounds"."""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from infer.speculative.proposer import DraftRequest, Proposer
from infer.speculative.theory import best_k_grid
from infer.speculative.tree import chain_shape

log = logging.getLogger("infer.engine")
OVERHEAD_STEP = 0.05  # round overheads are looked up to this many plain steps
MIN_VERIFY_COST = 0.05  # a negative overhead never makes verification (nearly) free
ALPHAS = [i / 100 for i in range(101)]  # acceptances the tables hold (percentiles)


class RequestLike(Protocol):
    request_id: str


class SpecPolicy(Protocol):
    """What the speculative runner asks of a length policy."""

    def choose(self, requests: Sequence[RequestLike], overhead: float = 0.0) -> list[int]:
        """K per request (before the length guards; 0 = plain); `overhead`: a round's plain steps beyond the model."""
        ...

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """A round of the request drafted `drafted` tokens and `accepted` of them passed."""
        ...

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A shadow round (no round ran) of the request scored (drafted, accepted)."""
        ...

    def release(self, request_id: str) -> None:
        """The request left: forget it."""
        ...

    def leak_report(self) -> list[str]:
        """Requests still tracked (when none should be)."""
        ...


class FixedPolicy:
    """K = spec_length for every request."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"spec_length must be >= 1, got {k}")
        self.k = k

    def choose(self, requests: Sequence[RequestLike], overhead: float = 0.0) -> list[int]:
        return [self.k] * len(requests)

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        pass

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def leak_report(self) -> list[str]:
        return []


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    k_max: int  # the longest draft (EngineConfig.spec_length)
    c: float  # draft step cost / target step cost (0: n-gram)
    verify_slope: float = 0.0  # v(K) = 1 + verify_slope * K plain steps
    prior_alpha: float = 0.6  # acceptance a request starts from
    prior_weight: float = 4.0  # ... worth this many tried tokens
    decay: float = 0.9  # the counts' weight after each round (memory of ~10 rounds)
    min_gain: float = 0.03  # speculate only where the factor is >= 1 + min_gain
    probe_every: int = 16  # plain steps before a probe
    probe_max: int = 256  # the longest wait between probes
    probe_budget: float = 0.25  # a probe drafts at most this many plain steps' worth (K c)
    probe_share: float = 0.03  # probes take at most this share of a plain request's time

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if self.c < 0 or self.verify_slope < 0:
            raise ValueError(f"c and verify_slope must be >= 0, got {self.c}, {self.verify_slope}")
        if not 0.0 <= self.prior_alpha <= 1.0 or self.prior_weight <= 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight > 0")
        if not 0.0 < self.decay <= 1.0 or self.min_gain < 0:
            raise ValueError("decay must be in (0, 1] and min_gain >= 0")
        if not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"need 1 <= probe_every <= probe_max, got {self.probe_every}, {self.probe_max}")
        if self.probe_budget < 0:
            raise ValueError(f"probe_budget must be >= 0, got {self.probe_budget}")
        if not 0.0 < self.probe_share <= 1.0:
            raise ValueError(f"probe_share must be in (0, 1], got {self.probe_share}")

    @property
    def probe_k(self) -> int:
        """A probe's draft length: what `probe_budget` buys at c, between 1 and k_max."""
        return self.k_max if self.c * self.k_max <= self.probe_budget else max(1, int(self.probe_budget / self.c))


@dataclass(slots=True)
class _Estimate:
    accepted: float = 0.0  # decayed accepted tokens
    tried: float = 0.0  # decayed tried tokens (accepted + first rejections)
    plain_steps: int = 0  # plain steps since the last round
    wait: int = 0  # plain steps before the next probe
    probe_len: int = 0  # the next probe's draft length (0: the config's probe_k)
    probing: bool = False  # the round in flight is a probe


class AdaptivePolicy:
    """K per request from its acceptance estimate and the walltime factor."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.config = config
        self._estimates: dict[str, _Estimate] = {}
        self._overhead = 0.0  # the last step's
        # per overhead (in OVERHEAD_STEP steps) the best K and its factor per acceptance percentile.
        # Below `_low` every v(K) is MIN_VERIFY_COST; above `_high` no K pays.
        c, slope, k_max = config.c, config.verify_slope, config.k_max
        self._low = math.floor((MIN_VERIFY_COST - 1.0 - slope * k_max) / OVERHEAD_STEP) - 1
        self._high = math.ceil(k_max / OVERHEAD_STEP) + 1
        rows = [[max(MIN_VERIFY_COST, 1.0 + slope * k + key * OVERHEAD_STEP) for k in range(1, k_max + 1)]
                for key in range(self._low, self._high + 1)]
        self._tables = best_k_grid(ALPHAS, k_max, c, rows)

    def round_cost(self, k: int) -> float:
        """A round drafting k tokens, in plain steps, by the model: k c + v(k); 1 for k = 0."""
        return k * self.config.c + 1.0 + self.config.verify_slope * k if k else 1.0

    def _table(self, overhead: float) -> list[tuple[int, float]]:
        key = min(max(round(overhead / OVERHEAD_STEP), self._low), self._high)
        return self._tables[key - self._low]

    def probe_floor(self, k: int, overhead: float) -> int:
        """The shortest wait (plain steps) before a probe of k drafts: its cost beyond a plain step
        over `probe_share`, within [`probe_every`, `probe_max`]."""
        cfg = self.config
        extra = max(0.0, self.round_cost(k) - 1.0 + overhead)
        return min(cfg.probe_max, max(cfg.probe_every, math.ceil(extra / cfg.probe_share)))

    def acceptance(self, request_id: str) -> float:
        """The request's current acceptance estimate (the prior for an unknown request)."""
        cfg = self.config
        e = self._estimates.get(request_id, _Estimate())
        return (e.accepted + cfg.prior_alpha * cfg.prior_weight) / (e.tried + cfg.prior_weight)

    def best(self, alpha: float, overhead: float = 0.0) -> int:
        """The best K at acceptance `alpha` and round `overhead`; 0 when none beats plain by min_gain."""
        k, factor = self._table(overhead)[round(min(max(alpha, 0.0), 1.0) * 100)]
        return k if factor >= 1.0 + self.config.min_gain else 0

    def choose(self, requests: Sequence[RequestLike], overhead: float = 0.0) -> list[int]:
        self._overhead = overhead
        ks = []
        for request in requests:
            e = self._estimates.get(request.request_id)
            if e is None:
                e = self._estimates[request.request_id] = _Estimate(wait=self.config.probe_every)
            k = self.best(self.acceptance(request.request_id), overhead)
            e.probing = False
            if k == 0:
                e.plain_steps += 1
                if e.plain_steps >= e.wait:
                    k, e.probing = e.probe_len or self.config.probe_k, True
            ks.append(k)
        return ks

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        e = self._estimates.get(request_id)
        if e is None:
            return
        cfg = self.config
        if drafted == 0:  # nothing was proposed (no n-gram match): a probe waits its turn again
            if e.probing:
                e.plain_steps, e.probing = 0, False
            return
        self._count(e, drafted, accepted)
        e.plain_steps = 0
        if e.probing:  # a probe with a rejection that leaves the request plain waits longer next time
            passed = accepted == drafted
            paid = passed or self.best(self.acceptance(request_id), self._overhead) > 0
            floor = self.probe_floor(drafted, self._overhead)
            e.wait = floor if paid else min(max(2 * e.wait, floor), cfg.probe_max)
            # a probe whose drafts all pass is followed by one twice as long (up to k_max)
            e.probe_len = min(cfg.k_max, 2 * drafted) if passed else 0
            e.probing = False

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """Evidence without a round (a `ShadowRounds` score): the acceptance estimate only."""
        e = self._estimates.get(request_id)
        if e is None or drafted < 1:
            return
        self._count(e, drafted, accepted)

    def _count(self, e: _Estimate, drafted: int, accepted: int) -> None:
        """Decay the counts, then add a round's accepted tokens (tried: and its first rejection)."""
        d = self.config.decay
        e.accepted = e.accepted * d + accepted
        e.tried = e.tried * d + accepted + (1 if accepted < drafted else 0)

    def release(self, request_id: str) -> None:
        self._estimates.pop(request_id, None)

    def leak_report(self) -> list[str]:
        return [f"adaptive policy still tracks {sorted(self._estimates)}"] if self._estimates else []


# -- the round clock ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ClockConfig:
    decay: float = 0.8  # an estimate's weight against each new interval
    refresh_steps: int = 256  # decode steps in a bucket before its plain time is measured again
    plain_samples: int = 3  # plain steps a measurement times: their median (one is noise)
    max_ratio: float = 50.0  # an interval this many times the bucket's plain step is a stall: dropped
    # the gate (`RoundClock.pays`): a bucket's first and longest wait (plain steps), a probe's rounds
    probe_wait: int = 64
    probe_wait_max: int = 2048
    probe_rounds: int = 4
    probe_share: float = 0.05  # ... and a wait long enough that probes lose at most this share of the time
    off_below: float = 0.95  # rounds on go off below this speedup; rounds off come back at 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.refresh_steps < 1 or self.max_ratio <= 1.0 or self.plain_samples < 1:
            raise ValueError(f"need refresh_steps >= 1, max_ratio > 1 and plain_samples >= 1, got "
                             f"{self.refresh_steps}, {self.max_ratio}, {self.plain_samples}")
        for name, value in (("probe_share", self.probe_share), ("off_below", self.off_below)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not 1 <= self.probe_wait <= self.probe_wait_max or self.probe_rounds < 3:
            raise ValueError(f"need 1 <= probe_wait <= probe_wait_max and probe_rounds >= 3 (a round is timed "
                             f"between two others), got {self.probe_wait}, {self.probe_wait_max}, {self.probe_rounds}")


@dataclass(frozen=True, slots=True)
class StepKind:
    batch: int  # decode rows
    k: int  # the step's longest draft; 0: a plain step
    tokens: float = 1.0  # tokens a decode row got (a round's: emitted over its rows)


@dataclass(slots=True)
class _Bucket:
    plain_s: float | None = None  # seconds a plain step
    overhead: float | None = None  # plain steps a round costs beyond the model
    since_plain: int = 0  # decode steps since plain_s was last sampled
    fresh: list[float] = field(default_factory=list)  # the samples of a plain measurement under way
    round_s: float | None = None  # the gate's: seconds a round
    round_tokens: float | None = None  # ... and the tokens it gives a row
    waited: int = 0  # plain steps the gate kept since its last probe
    wait: int = 0  # ... the wait before its next (0: rounds pay)
    probe_left: int = 0  # rounds left of the probe running
    steps: list[int] = field(default_factory=lambda: [0, 0])  # decode steps run here: [plain, rounds]
    samples: list[int] = field(default_factory=lambda: [0, 0])  # ... of them timed: [plain, rounds]


def bucket(batch: int) -> int:
    """The batch-size bucket: the smallest power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


class RoundClock:
    """Plain step and round times per batch bucket, from step start times: the adaptive
    policy's round overhead and the gate that turns rounds off where they do not pay."""

    def __init__(self, model_cost: Callable[[int], float] | None, config: ClockConfig | None = None,
                 gate: bool = False) -> None:
        # a round of longest draft k in plain steps, by the policy's model (None: no overhead kept)
        self.model_cost = model_cost
        self.gate = gate  # whether `pays` is asked
        self.config = config or ClockConfig()
        self._buckets: dict[int, _Bucket] = {}
        self._recent: list[tuple[float, StepKind | None]] = []  # the last two steps: (start, kind)

    def needs_plain(self, batch: int) -> bool:
        """Whether the bucket's plain step time is missing or stale; not for a gate alone where a
        larger batch's rounds pay (a round's relative cost grows with the batch)."""
        if self.model_cost is None and self._pays_above(bucket(batch)):
            return False
        b = self._buckets.get(bucket(batch))
        return b is None or b.plain_s is None or b.since_plain >= self.config.refresh_steps

    def _pays_above(self, key: int) -> bool:
        """Whether a bucket larger than `key` has rounds on that pay, as measured."""
        return any(k > key and not b.wait and (r := self.speedup(k)) is not None and r >= 1.0
                   for k, b in self._buckets.items())

    def overhead(self, batch: int) -> float:
        """Plain steps a round at this batch size costs beyond the model (0 until measured)."""
        b = self._buckets.get(bucket(batch))
        return 0.0 if b is None or b.overhead is None else b.overhead

    def plain_step_s(self, batch: int) -> float | None:
        """Seconds a plain step takes at this batch size, as measured (None until then)."""
        b = self._buckets.get(bucket(batch))
        return None if b is None else b.plain_s

    def speedup(self, batch: int) -> float | None:
        """Tokens a second of rounds over plain steps at this batch size (None until both are measured)."""
        b = self._buckets.get(bucket(batch))
        if b is None or b.plain_s is None or b.round_s is None or b.round_tokens is None:
            return None
        return b.round_tokens * b.plain_s / b.round_s

    def gate_state(self) -> dict[int, tuple[float, bool]]:
        """Per measured bucket (a power of two): (rounds' speedup over plain steps, rounds on now)."""
        return {k: (float(b["speedup"]), bool(b["rounds_on"])) for k, b in self.report().items()
                if b["speedup"] is not None}

    def report(self) -> dict[int, dict[str, float | bool | None]]:
        """Per measured bucket: plain step and round ms, a round's tokens a row, speedup, whether
        rounds are on (else the plain steps waited of the wait), and the decode steps of each kind
        run and timed (a benchmark's record)."""
        def ms(s: float | None) -> float | None:
            return None if s is None else s * 1e3

        return {k: {"plain_ms": ms(b.plain_s), "round_ms": ms(b.round_s), "round_tokens": b.round_tokens,
                    "speedup": self.speedup(k), "rounds_on": not b.wait, "waited": b.waited, "wait": b.wait,
                    "plain_steps": b.steps[0],
                    "round_steps": b.steps[1], "plain_samples": b.samples[0], "round_samples": b.samples[1]}
                for k, b in sorted(self._buckets.items())}

    def holds_off(self, batch: int) -> bool:
        """Whether `pays(batch)` will answer no on this step (nothing changed by asking): the
        bucket's gate is off, no probe runs and its wait is not over."""
        b = self._buckets.get(bucket(batch))
        if b is None or not b.wait or b.probe_left > 0 or b.waited >= b.wait:
            return False
        ratio = self.speedup(batch)
        return ratio is not None and ratio < 1.0

    def pays(self, batch: int) -> bool:
        """The gate, asked once a step that would draft: whether rounds at this batch size give at
        least plain steps' tokens a second (yes until measured; off below `off_below`). Off, the
        bucket steps plainly and probes after a backing-off wait (docs/speculation.md, "The batch gate")."""
        b = self._buckets.setdefault(bucket(batch), _Bucket())
        if b.probe_left > 0:
            b.probe_left -= 1
            return True
        ratio = self.speedup(batch)
        if ratio is None or ratio >= (1.0 if b.wait else self.config.off_below):
            if b.wait and ratio is not None:
                log.info("speculation on again at batch size %d: rounds give %.2fx plain steps' tokens a second",
                         batch, ratio)
            b.wait = b.waited = 0
            return True
        cfg = self.config
        assert b.plain_s is not None and b.round_s is not None and b.round_tokens is not None
        lost = cfg.probe_rounds * max(0.0, b.round_s / b.plain_s - b.round_tokens)
        floor = min(max(cfg.probe_wait, math.ceil(lost / cfg.probe_share)), cfg.probe_wait_max)
        if not b.wait:
            b.wait = floor
            log.info("speculation off at batch size %d: rounds give %.2fx plain steps' tokens a second (probed "
                     "again after %d plain steps)", batch, ratio, b.wait)
        b.waited += 1
        if b.waited <= b.wait:
            return False
        b.waited, b.wait, b.probe_left = 0, min(max(2 * b.wait, floor), cfg.probe_wait_max), cfg.probe_rounds - 1
        return True

    def stepped(self, start: float, kind: StepKind | None) -> None:
        """A step that started at `start` (seconds) ran; kind None: not a pure decode step.
        The step before it is a sample when the steps on both its sides are of its kind."""
        if kind is not None:
            b = self._buckets.setdefault(bucket(kind.batch), _Bucket())
            b.since_plain += 1
            b.steps[kind.k > 0] += 1
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
        b.samples[kind.k > 0] += 1
        if kind.k == 0:
            if b.plain_s is None or b.since_plain >= self.config.refresh_steps:  # (a measurement)
                b.fresh.append(seconds)
                if len(b.fresh) < self.config.plain_samples:
                    return
                seconds = statistics.median(b.fresh)
                b.fresh.clear()
            b.plain_s = seconds if b.plain_s is None else d * b.plain_s + (1 - d) * seconds
            b.since_plain = 0
            return
        if self.gate:
            b.round_s = seconds if b.round_s is None else d * b.round_s + (1 - d) * seconds
            b.round_tokens = kind.tokens if b.round_tokens is None else d * b.round_tokens + (1 - d) * kind.tokens
        if b.plain_s is not None and self.model_cost is not None:
            extra = seconds / b.plain_s - self.model_cost(kind.k)
            b.overhead = extra if b.overhead is None else d * b.overhead + (1 - d) * extra


# -- shadow rounds -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Pending:
    start: int  # the request's token count when the chain was drafted: chain[i] guesses token start + i
    chain: tuple[int, ...]


def score(chain: Sequence[int], produced: Sequence[int]) -> int | None:
    """Accepted tokens of `chain` against the tokens `produced` after it: the common prefix once
    decided (a mismatch, or every draft present); None while more tokens are needed."""
    for i, token in enumerate(chain):
        if i >= len(produced):
            return None
        if produced[i] != token:
            return i
    return len(chain)


class _Known:
    """A request seen without its tokens in flight: what a proposer may read of it."""

    def __init__(self, request: DraftRequest) -> None:
        self._request = request
        self.num_tokens, self.pending_tokens = request.num_tokens - request.pending_tokens, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._request, name)


def known_tokens(request: DraftRequest) -> DraftRequest:
    """`request` itself when every token is known, else a view of its known tokens."""
    return request if not request.pending_tokens else _Known(request)  # type: ignore[return-value]


class ShadowRounds:
    """Pending shadow chains per request: a free draft's score while its request decodes plainly."""

    def __init__(self, proposer: Proposer, k: int) -> None:
        if k < 1:
            raise ValueError(f"shadow rounds draft k >= 1 tokens, got {k}")
        self.proposer, self.k = proposer, k
        self._pending: dict[str, _Pending] = {}

    def settle(self, requests: Sequence[DraftRequest]) -> list[tuple[str, int, int]]:
        """(request_id, drafted, accepted) of the pending chains their tokens now decide (dropped)."""
        done = []
        for request in requests:
            p = self._pending.get(request.request_id)
            if p is None:
                continue
            accepted = score(p.chain, request.token_slice(p.start, min(request.num_tokens, p.start + len(p.chain))))
            if accepted is not None:
                done.append((request.request_id, len(p.chain), accepted))
                del self._pending[request.request_id]
        return done

    def draft(self, requests: Sequence[DraftRequest]) -> None:
        """Keep the chain the proposer would draft now from the known tokens, per request without one."""
        fresh = [known_tokens(r) for r in requests if r.request_id not in self._pending]
        if not fresh:
            return
        drafts = self.proposer.propose(fresh, chain_shape(self.k), [self.k] * len(fresh))
        for request, d in zip(fresh, drafts, strict=True):
            if d.num_proposed:
                self._pending[request.request_id] = _Pending(request.num_tokens, d.token_ids[:d.num_proposed])

    def drop(self, request_id: str) -> None:
        """The request speculates or left: forget its pending chain."""
        self._pending.pop(request_id, None)

    def leak_report(self) -> list[str]:
        return [f"shadow chains kept for {sorted(self._pending)}"] if self._pending else []
