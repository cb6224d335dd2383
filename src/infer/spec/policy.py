"""Speculation length policy: how many tokens to draft for each request this round.

fixed: K for everyone. adaptive: per request, pick the K in 0..K_max that maximises the
paper's expected walltime factor (Leviathan et al., Theorem 3.8, with the verification cost
measured rather than assumed equal to one target step):

    factor(K) = (1 - a^(K+1)) / ((1 - a) * (K * c + v(K)))

a: the request's acceptance estimate; c: draft step time / plain target step time;
v(K): verification time for K+1 tokens / plain target step time (v(0) = 1, so K = 0, plain
decoding, has factor 1 and is chosen whenever no K pays). Costs are measured per batch size
by the runner: calibrated at start-up, then replaced by the measured wall time of real
steps (host overhead included). A request at K = 0 is probed with K = 1 now and then
(backing off exponentially while probes keep failing) so the estimate can recover.

Both policies apply the overflow guard: K never exceeds the room left before max_seq_len
(positions n .. n+K must fit) nor the tokens the request may still emit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per round, (1 - a^(k+1)) / (1 - a) (paper, Eq. 1)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def walltime_factor(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding (Theorem 3.8, generalised verify cost)."""
    return expected_tokens(a, k) / (k * c + verify_cost)


def best_k(a: float, k_max: int, c: float, verify_costs: Sequence[float]) -> int:
    """argmax over K in 0..k_max of walltime_factor; verify_costs[K] for K = 0..k_max."""
    return best_k_for_costs(a, [k * c + verify_costs[k] for k in range(k_max + 1)])


def best_k_for_costs(a: float, relative_costs: Sequence[float], margin: float = 0.0) -> int:
    """argmax over K of expected tokens per step / relative step cost r(K) (r(0) = 1).

    With `margin`, speculating must beat plain decoding by that fraction: near break-even,
    switching back and forth costs more than either choice (the draft must catch up).
    """
    scores = [expected_tokens(a, k) / relative_costs[k] for k in range(len(relative_costs))]
    best = max(range(len(scores)), key=lambda k: (scores[k], -k))
    return best if scores[best] > scores[0] * (1.0 + margin) else 0


def guard_k(k: int, seq_len: int, max_seq_len: int, tokens_left: int) -> int:
    """Overflow guard: positions seq_len..seq_len+k must fit; no more drafts than can be emitted."""
    return max(0, min(k, max_seq_len - seq_len - 1, tokens_left - 1))


class RequestLike(Protocol):
    request_id: str
    num_computed_tokens: int


@dataclass
class CostModel:
    """Step costs relative to a plain decode step, per batch-size bucket.

    Calibration (start-up, forward passes only) gives c and v(K); the runner then reports
    the measured wall time of every step (`observe`), host overhead included, and measured
    costs replace the calibrated ones as they arrive. So a setup where per-step overhead
    dominates (tiny models) learns that speculating does not pay.
    """

    k_max: int
    draft_ratio: dict[int, float] = field(default_factory=dict)  # bucket -> c
    verify_ratio: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [v(0..k_max)]
    observed: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, k) -> EMA seconds
    smoothing: float = 0.2

    @staticmethod
    def bucket(batch_size: int) -> int:
        b = 1
        while b < batch_size:
            b *= 2
        return b

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        key = (self.bucket(batch_size), k)
        old = self.observed.get(key)
        self.observed[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def has_plain(self, batch_size: int) -> bool:
        return (self.bucket(batch_size), 0) in self.observed

    def calibrated(self, batch_size: int) -> tuple[float, list[float]]:
        b = self.bucket(batch_size)
        keys = sorted(self.verify_ratio) or [b]
        near = min(keys, key=lambda x: abs(x - b))
        return self.draft_ratio.get(near, 0.5), self.verify_ratio.get(near, [1.0] * (self.k_max + 1))

    def relative_costs(self, batch_size: int) -> list[float]:
        """r(K) = step time with K drafts / plain step time, K = 0..k_max (r(0) = 1)."""
        b = self.bucket(batch_size)
        c, v = self.calibrated(batch_size)
        plain = self.observed.get((b, 0))
        out = [1.0]
        for k in range(1, self.k_max + 1):
            seen = self.observed.get((b, k))
            out.append(seen / plain if seen is not None and plain else k * c + v[k])
        return out


class SpecPolicy(Protocol):
    def choose(self, requests: Sequence[RequestLike], seq_lens: Sequence[int], max_seq_len: int,
               tokens_left: Sequence[int]) -> list[int]: ...

    def update(self, request_id: str, num_draft: int, num_accepted: int) -> None: ...

    def release(self, request_id: str) -> None: ...


@dataclass
class FixedPolicy:
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"spec_length must be >= 1, got {self.k}")

    def choose(self, requests: Sequence[RequestLike], seq_lens: Sequence[int], max_seq_len: int,
               tokens_left: Sequence[int]) -> list[int]:
        return [guard_k(self.k, n, max_seq_len, left) for n, left in zip(seq_lens, tokens_left, strict=True)]

    def update(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        return None

    def release(self, request_id: str) -> None:
        return None


@dataclass
class _Estimate:
    accepted: float
    trials: float  # accepted + rejections (geometric model: each trial accepts with prob a)
    probe_wait: int = 0
    probe_interval: int = 4


@dataclass
class AdaptivePolicy:
    k_max: int
    costs: CostModel
    prior_a: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.9  # per-round forgetting of old evidence
    max_probe_interval: int = 64
    plain_refresh: int = 256  # every this many steps, one plain step re-measures the baseline
    switch_margin: float = 0.05  # speculate only when predicted to beat plain by 5 %
    _est: dict[str, _Estimate] = field(default_factory=dict)
    _steps: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"spec_length must be >= 1, got {self.k_max}")

    def acceptance(self, request_id: str) -> float:
        e = self._est.get(request_id)
        return self.prior_a if e is None else e.accepted / e.trials

    def choose(self, requests: Sequence[RequestLike], seq_lens: Sequence[int], max_seq_len: int,
               tokens_left: Sequence[int]) -> list[int]:
        self._steps += 1
        if not self.costs.has_plain(len(requests)) or self._steps % self.plain_refresh == 0:
            return [0] * len(requests)  # measure (or re-measure) a plain step at this batch size
        costs = self.costs.relative_costs(len(requests))
        ks = []
        for r, n, left in zip(requests, seq_lens, tokens_left, strict=True):
            est = self._est.setdefault(r.request_id, _Estimate(self.prior_a * self.prior_weight, self.prior_weight))
            k = best_k_for_costs(est.accepted / est.trials, costs, self.switch_margin)
            if k == 0:
                est.probe_wait += 1
                if est.probe_wait >= est.probe_interval:
                    est.probe_wait, k = 0, 1
            ks.append(guard_k(k, n, max_seq_len, left))
        return ks

    def update(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        est = self._est.setdefault(request_id, _Estimate(self.prior_a * self.prior_weight, self.prior_weight))
        rejected = 1 if num_accepted < num_draft else 0
        est.accepted = est.accepted * self.decay + num_accepted
        est.trials = est.trials * self.decay + num_accepted + rejected
        if num_draft == 1 and num_accepted == 0:  # a failed probe: wait longer next time
            est.probe_interval = min(est.probe_interval * 2, self.max_probe_interval)
        elif num_accepted > 0:
            est.probe_interval = 4

    def release(self, request_id: str) -> None:
        self._est.pop(request_id, None)
