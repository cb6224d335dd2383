"""What exploring speculation lost against plain decoding, and where it must stop for a while.

The adaptive policy's mechanisms each bound a cost of their own: probes spend a budget,
episodes that fall short raise the price of rounds (kappa, spec/episodes.py), a vetoed
batch is asked again only after a hold, shadow drafts pause where they led nowhere. Their
sum is bounded by none of them, and it is what the user sees: on the H100 demo pair at W2
(n-gram, T=0, run 24f) the decisions that expired for probes and veto holds, the short
episodes at batch 24-32 and the shadows' upkeep at batch 1-8 each cost ~0.5-2 % of the
workload, together 4.4 %, against a goal of 3 %.

`LossLedger` keeps, per cost bucket and sampling mode (a *key*), the net time speculation's
machinery cost beyond what plain decoding would have taken for the same tokens: each decode
step outside a bare plain stretch is charged its wall time less its tokens' worth in plain
steps (a round that emits 3 tokens a request in the time of 2 plain steps is a gain of one
plain step; a plain step that asked `choose` is charged what it cost over a plain step),
and a plain stretch its shadows' and tables' upkeep. The runner charges, the policy
(`AdaptivePolicy.charge`) adds the elapsed decode time: the policy steps since the previous
charge at the plain step's cost.

A key is *locked* (`locked`) when its net loss is positive and either it alone, or all keys
together, lost more than `budget` of the elapsed time (judged once `min_steps` policy steps
have run since the engine started): its batches decode plainly, without probes, shadow
drafts or new tables, for `lock_steps` policy steps, doubled for each lock in a row of that
key (up to `max_lock_steps`); a key charged into a net gain starts its doubling over. A lock
clears the key's loss: once it ends, speculation there is tried afresh, at the cost of one
more budget's worth at most. Every `window` policy steps the sums halve, so old evidence
fades.

So exploring costs at most about `budget` of the recent decode time (plus what it lost
before its first judgement, `min_steps`), whatever mechanism it comes from; where
speculation pays (a net gain) nothing changes. H100 demo pair, W2 and W2-prefix at T=0 and
T=1 (runs 25b-25e): every cell 0.979-0.998 of plain decoding on quiet hosts, where 24f-24g
read 0.956-0.998; batch 1 unchanged (n-gram W1 T=0 2.33x, W5 T=0 1.65x).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[int, bool]  # (cost bucket, the batch samples)


@dataclass
class LossLedger:
    # the share of the elapsed decode time exploring may lose, net. Against the sums of a
    # window that halves every `window` steps: the allowance is what a key that starts
    # exploring (a new sampling mode, a lock's end) may lose before it is locked, ~10 ms
    # at W2 on the H100 demo pair; at 1 % and a window of 4096 it was 40-80 ms, and a key
    # unlocked lost up to ~1/4 of a W2 generation before it was locked again (run 25a)
    budget: float = 0.005
    min_steps: int = 256  # policy steps before any key may be locked
    window: int = 1024  # policy steps after which the sums halve
    # a lock's length: at 2048 policy steps (~8 W2 generations) a 10-generation A/B saw
    # each key unlocked and exploring again, at the price of the first lock (run 25a)
    lock_steps: int = 8192
    max_lock_steps: int = 65536
    _loss: dict[Key, float] = field(default_factory=dict)  # net seconds lost, decayed
    _total: float = 0.0  # their sum (kept as they change: a charge comes with every round)
    _elapsed: float = 0.0  # decode seconds elapsed (policy steps at the plain step's cost), decayed
    _clock: int = 0  # the policy step of the latest charge
    _next_halving: int = 0
    _locked_until: dict[Key, int] = field(default_factory=dict)
    _locks: dict[Key, int] = field(default_factory=dict)  # locks in a row, per key
    locks_taken: int = 0  # (for reports and tests)

    def __post_init__(self) -> None:
        if not 0.0 < self.budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {self.budget}")
        if self.min_steps < 1 or self.window < self.min_steps:
            raise ValueError(f"need 1 <= min_steps <= window, got {self.min_steps} and {self.window}")
        if not 1 <= self.lock_steps <= self.max_lock_steps:
            raise ValueError(f"need 1 <= lock_steps <= max_lock_steps, got {self.lock_steps} and "
                             f"{self.max_lock_steps}")
        self._next_halving = self.window

    def locked(self, key: Key, step: int) -> bool:
        """Whether `key` decodes plainly, exploring nothing, at policy step `step`."""
        until = self._locked_until.get(key)
        return until is not None and step < until

    def locked_keys(self, step: int) -> list[Key]:
        """The keys locked at policy step `step` (a snapshot first: the server's metrics read
        it from another thread than the engine loop's)."""
        return [key for key, until in list(self._locked_until.items()) if step < until]

    def lock_end(self, key: Key) -> int:
        """The policy step at which `key`'s lock ends (0: never locked)."""
        return self._locked_until.get(key, 0)

    def loss(self, key: Key) -> float:
        """The key's net seconds lost in the window (negative: a gain)."""
        return self._loss.get(key, 0.0)

    @property
    def elapsed(self) -> float:
        return self._elapsed

    def charge(self, key: Key, lost: float, step: int, plain_seconds: float) -> bool:
        """Charge `lost` seconds (negative: a gain) to `key` at policy step `step`; the steps
        since the previous charge count as elapsed at `plain_seconds` each. Returns whether a
        lock was taken (some key's)."""
        while step >= self._next_halving:
            self._halve()
        if step > self._clock:
            self._elapsed += (step - self._clock) * plain_seconds
            self._clock = step
        loss = self._loss[key] = self._loss.get(key, 0.0) + lost
        self._total += lost
        if loss < 0.0 and key in self._locks:
            del self._locks[key]  # a gain: the next lock starts short again
        if step < self.min_steps:  # (the engine's first steps: too little to judge by)
            return False
        allowed = self.budget * self._elapsed
        if loss <= allowed and self._total <= allowed:  # (the common case, in O(1))
            return False
        return self._judge(step, allowed)

    def _judge(self, step: int, allowed: float) -> bool:
        total = self._total
        locking = [key for key, lost in self._loss.items()
                   if lost > 0.0 and (lost > allowed or total > allowed) and not self.locked(key, step)]
        for key in locking:
            n = self._locks.get(key, 0)
            self._locked_until[key] = step + min(self.lock_steps << n, self.max_lock_steps)
            self._locks[key] = n + 1
            self._total -= self._loss[key]
            self._loss[key] = 0.0
            self.locks_taken += 1
        return bool(locking)

    def _halve(self) -> None:
        self._elapsed /= 2
        self._total /= 2
        for key in self._loss:
            self._loss[key] /= 2
        self._next_halving += self.window
