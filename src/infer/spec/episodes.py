"""Speculative episodes: what speculating really gained, against what the policy predicted.

The adaptive policy predicts a round's gain from the request's acceptance estimate and the
measured step costs r(K) (spec/policy.py). What a switch to speculation really costs is
more than its rounds:

- the plain step after the last round, and the first round after plain steps, run host
  code that has gone cold (H100, demo target: +30-85 us over a plain step in a stretch;
  a `choose` that takes ~3 us in a loop takes 20-150 us there);
- asks that find no draft (n-gram misses) cost a lookup and a step outside the thin path;
- selection: a request starts when its estimate is high, partly by chance, and on sampled
  text (a draft token is accepted with probability p(t)) chance is most of it.

On the demo pair at T=1 this made n-gram adaptive 2-4 % slower than plain decoding: single
rounds, started at a predicted gain of 5-30 %, each followed by a cold plain step.

An *episode* runs from a step at which the policy starts speculating (some request is given
k > 0, not as a probe; its lookups may all miss) until a standing all-plain decision takes
over, the batch changes, or, after a few steps, it is found losing: fewer tokens than
plain decoding would have emitted in its time (`losing`; the runner's
`EPISODE_CHECK_STEPS`), so that an episode priced far too low is heard of before it ends on
its own.
The runner times its decode steps (one-off setup excluded, a draft model's catch-up
included) and counts the tokens they emitted. Measured in plain steps (the plain baseline's
seconds), an episode that emitted T tokens per request in S plain steps' time realized T;
the policy predicted `gain * S` for it, where `gain` is its expected tokens per plain step's
time when it started (raw costs).

`GainCalibration` keeps per cost bucket and sampling mode the decayed sums of realized and
predicted tokens. Their ratio, kappa, clamped to [min_factor, 1], divides the cost of every
round (r(K) for K > 0) in the policy's cost table: a mode whose episodes fall short of
their predictions needs a larger predicted gain to speculate; one whose episodes keep their
promise (kappa 1) is priced as measured. Never above 1: a mode that does better than
predicted is left to its own estimates (rounds long enough to show it are not marginal).

A low kappa can lock a mode out: no K pays, so no episode comes to raise it (and where
nothing could pay even at the optimistic acceptance, shadow drafts stop too). So a key's
evidence also relaxes toward the prior (kappa 1) with a half-life of `half_life` policy
steps (`relax`, at each cost-table pricing): traffic that changes is tried again, at the
price of an episode or two every few thousand steps.

`rate` is what episodes realized outright: tokens per request per plain step's time (1.0:
plain decoding's rate), from decayed sums of their realized tokens and plain steps. The
adaptive policy weighs a proposer's per-request state against it (`table_pays`: an n-gram
table costs a few us a token to build and keep; where speculation realized little at a
batch size, a table for a request with few tokens left cannot pay for itself). Its
evidence fades with the same half-life (`relax`), to nothing: a mode not tried for long is
unknown again (None), and tried afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Episode:
    """A run of decode steps from the start of speculation to the next all-plain decision."""

    batch_size: int
    sampled: bool  # the batch samples (spec/costs.py `batch_samples`)
    gain: float  # predicted tokens per request per plain step's time, at the start (raw costs)
    seconds: float = 0.0  # the steps' decode time (one-off setup excluded)
    tokens: int = 0  # tokens the steps emitted, all requests together
    steps: int = 0
    mixed: bool = False  # some engine step in it also ran prefill chunks: its time is not its own

    def add(self, seconds: float, tokens: int, mixed: bool = False) -> None:
        """A decode step of the episode (`mixed`: its engine step also ran prefill chunks)."""
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1
        self.mixed = self.mixed or mixed

    def extend(self, seconds: float) -> None:
        """Time its latest step held the loop beyond its decode (retiring it, scheduling the
        next: the runner's `_until_next_step`)."""
        self.seconds += seconds

    def losing(self, plain_seconds: float | None) -> bool:
        """Whether, so far, it emitted fewer tokens per request than plain decoding would
        have in its time (its `outcome` tells, and realized < plain steps of time)."""
        outcome = self.outcome(plain_seconds)
        return outcome is not None and outcome[1] < outcome[0]

    def outcome(self, plain_seconds: float | None) -> tuple[float, float, float] | None:
        """(plain steps of time, realized tokens per request, predicted tokens per request),
        or None when there is nothing to tell (no step, no plain baseline, prefill work in
        its time)."""
        if self.mixed or not self.steps or not plain_seconds or self.seconds <= 0.0:
            return None
        plain_steps = self.seconds / plain_seconds
        return plain_steps, self.tokens / self.batch_size, self.gain * plain_steps


@dataclass
class GainCalibration:
    """Per (cost bucket, sampled): realized / predicted tokens of recent episodes (see the
    module docstring). Starts at 1 with `prior_tokens` of weight; old episodes decay by
    `decay` per plain step of newer episodes' time."""

    prior_tokens: float = 8.0
    decay: float = 0.98
    min_factor: float = 0.25
    half_life: float = 2048.0  # policy steps over which a key's evidence relaxes halfway to the prior
    min_rate_steps: float = 8.0  # plain steps of episodes (decayed) before `rate` tells anything
    _sums: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)  # key -> (realized, predicted)
    _rates: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)  # key -> (realized, plain steps)
    _relaxed_at: dict[tuple[int, bool], int] = field(default_factory=dict)  # key -> policy step of its last `relax`

    def __post_init__(self) -> None:
        if self.prior_tokens <= 0:
            raise ValueError(f"prior_tokens must be > 0, got {self.prior_tokens}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 < self.min_factor <= 1.0:
            raise ValueError(f"min_factor must be in (0, 1], got {self.min_factor}")
        if self.half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")
        if self.min_rate_steps <= 0:
            raise ValueError(f"min_rate_steps must be > 0, got {self.min_rate_steps}")

    def relax(self, key: tuple[int, bool], step: int) -> None:
        """Move the key's evidence toward the prior for the policy steps since its last
        `relax` (the first call only starts the clock)."""
        last = self._relaxed_at.get(key)
        self._relaxed_at[key] = step
        if last is None or step <= last:
            return
        w = 0.5 ** ((step - last) / self.half_life)
        sums = self._sums.get(key)
        if sums is not None:
            prior = self.prior_tokens * (1.0 - w)
            self._sums[key] = (sums[0] * w + prior, sums[1] * w + prior)
        rates = self._rates.get(key)
        if rates is not None:  # (toward no evidence: `rate` None once too little is left)
            self._rates[key] = (rates[0] * w, rates[1] * w)

    def observe(self, key: tuple[int, bool], plain_steps: float, realized: float, predicted: float) -> None:
        """An episode of `plain_steps` plain steps' time that emitted `realized` tokens per
        request where `predicted` were expected."""
        if plain_steps <= 0 or predicted <= 0:
            return
        r, p = self._sums.get(key, (self.prior_tokens, self.prior_tokens))
        d = self.decay ** plain_steps
        self._sums[key] = (r * d + realized, p * d + predicted)
        tokens, steps = self._rates.get(key, (0.0, 0.0))
        self._rates[key] = (tokens * d + realized, steps * d + plain_steps)

    def rate(self, key: tuple[int, bool]) -> float | None:
        """Tokens per request per plain step's time that the key's recent episodes realized
        (plain decoding: 1.0), or None while they add up to fewer than `min_rate_steps`
        plain steps (never tried, or their evidence relaxed away)."""
        rates = self._rates.get(key)
        if rates is None or rates[1] < self.min_rate_steps:
            return None
        return rates[0] / rates[1]

    def factor(self, key: tuple[int, bool]) -> float:
        """kappa in [min_factor, 1]: 1 until episodes fall short of their predictions."""
        sums = self._sums.get(key)
        if sums is None:
            return 1.0
        return min(1.0, max(self.min_factor, sums[0] / sums[1]))
