"""Speculation length policy: how many tokens to draft for each request this round.

fixed: K for everyone. adaptive: per request, pick the K in 0..K_max that maximises the
paper's expected walltime factor (Leviathan et al., Theorem 3.8, with the verification cost
measured rather than assumed equal to one target step):

    factor(K) = (1 - a^(K+1)) / ((1 - a) * (K * c + v(K)))

a: the request's acceptance estimate (decayed counts over a prior: 0.6 for a greedy
request, 0.3 for one sampling at a temperature > 0, which accepts a draft token t only
with probability p(t), until requests of its kind have finished: then a moving average of
what they accepted, `learned_weight` per request, so a new request starts where the pair
and the traffic stand instead of re-learning it with probes); c: draft step time / plain target step time;
v(K): verification time for K+1 tokens / plain target step time (v(0) = 1, so K = 0, plain
decoding, has factor 1 and is chosen whenever no K pays by the margin: `switch_margin` (5 %)
to start speculating, `stay_margin` (0) to go on, so an estimate near the threshold does not
flap between the two and pay the switch each time). The costs
come from the `CostModel` (spec/costs.py): calibrated at start-up, then measured on real
steps, host overhead included.

A request at K = 0 is probed now and then so its estimate can recover: one round with
the K that would pay best at an optimistic acceptance (`optimistic_a`; a round's host
overhead is most of its cost, so K tokens tell much more than one at little more cost),
or K = 1 when nothing could pay even then (such probes only re-measure the costs), or for
shadowed requests (below). Probes are paid from a per-request credit that accrues at
`probe_budget` (1 %) of the steps, a tenth of that when nothing could pay or shadow drafts
(below) measure the acceptance, since such probes only re-measure the costs; a batch's
requests share the budget (each accrues its share: a probe's round costs the whole batch's
step, so 32 requests each at the full rate spent 32 times it). A probe is
charged its cost (its round plus the switching cost: a draft model must first catch up on
the tokens it skipped) less the one token it surely emits, and refunded each draft token
accepted; it is due when the credit covers its loss expected at the request's estimate.
So probes that pay for themselves (good drafts) follow one another and their evidence
adds up until speculation pays, and failing ones grow rare. A new greedy request gets the
budget of the tokens it may still emit (at most one probe) in advance: unless its prior
acceptance expects the probe to lose more (the catch-up counted for its whole context),
its first probe comes within a few steps, while most of the request is ahead (sampled
requests wait for their credit). Until a
round's cost is known at a batch size (measured lately: measurements expire), probes come
early, every request's whose backoff ended (calibration can misjudge host overhead either
way, and a round measured only while slow must not price speculation out for good; the
probes of a step share one round, which then costs what a round of many drafts costs: one
request probing alone, as tried in 19a-19e, measured rounds of one draft, priced the
batch's rounds cheap, and the draft model at W2 T=0 ran 80-150 rounds a generation at a
loss), unless such a probe would cost more than `early_probe_share` of the plain steps its
request has left (the draft's catch-up in it): then it waits for its credit like any other.
Failed probes also back off exponentially.
An accepted probe restarts an estimate below the prior from the prior (the text changed
since speculation stopped paying); one at or above the prior keeps its evidence.

A request given k > 0 for which the proposer has nothing (an n-gram miss) says nothing
about acceptance: it costs a lookup (a probe's charge is refunded), so the request just
does not ask again for a while, 2, 4, 8 ... up to `max_probe_interval` steps after
consecutive misses, and asks every step again after a hit (repetitive text comes and
goes: code edits match, then miss at the edit, then match again). A step in which every
request given k > 0 found nothing leaves the batch under a standing all-plain decision
until the first backoff or probe ends, as the next `choose` would decide (without asking it).
With shadow drafts (below) the runner watches a request that missed while speculating (not
a probe, whose estimate keeps it plain): it looks the request up under each plain step's
forward and calls `proposal_ready` once a draft (of two tokens or more) had its first token
emitted, which ends the request's backoff. A sampled request waits for that (its backoff is
`max_probe_interval` at once, a bound should the call never come) instead of asking on a
schedule; a greedy one keeps the 2, 4, 8 ... backoff too.

With a proposer whose drafts are deterministic and free (n-gram), the runner also takes
shadow drafts during plain steps and reports how much of each the following tokens matched
(`observe_shadow`, spec/shadow.py): the estimate of a request at K = 0 then follows the
text without probes, and `shadowed` turns off the restart from the prior after a probe;
its probes draft one token, are priced at acceptance 0, get no advance and a tenth of the
budget.
A shadowed request also decodes plainly until its first shadow draft is counted: the
prior alone would have it speculate on text where drafts keep failing, at a cost, when
the evidence comes for free a few steps later. Once requests of its kind have finished,
though, their learned prior is evidence: a request starts at it where it would speculate
(`learned_start`).

A round costs the whole batch r(max K) plain steps, so at batch > 1 the requests' choices
must pay for the batch: their expected tokens (one for a request without drafts) against
batch * r(max K), by the switch margin to start and the stay margin to go on; if not, the
requests that were to speculate decode plainly (probes go on) and the batch is asked again
after `veto_hold` steps (doubling with each veto in a row, up to `max_veto_hold`), not at
each request's new shadow evidence (on the H200 demo pair at
W2, T=1, a few requests that drafted well had the batch of 32 speculate at nearly every step,
each round costing ~2.2 plain steps for ~1 token a request: +59 % of the time, run 15a).
With drafts whose rows cost next to nothing (n-gram: `riders`), every request with
evidence and no miss backoff rides along in a round that runs anyway, with the round's K
(the verification pads each row to its width), and the economics count what riders are
expected to emit. What could pay at a batch size (the shadow gate below, the probes' K and
budget) is judged alike, with one request at `optimistic_a` and the rest at `batch_acceptance`: their kind's
prior plus `batch_optimism`.

Shadows have a patience: where `shadow_patience` decode steps took them at a cost bucket and
sampling mode without speculation starting there, they (and the tables they read) pause
for `shadow_pause` policy steps (`count_shadowed`, `worth_shadowing`).

What switching to speculation really cost is measured too: the runner times each
*episode*, from a choice that starts speculating to the next all-plain decision, and
reports it (`observe_episode`) with the gain `episode_gain` predicted for it. The
realized / predicted ratio per cost bucket and sampling mode (kappa <= 1,
spec/episodes.py) divides the cost of every round in the policy's cost table, so a mode
whose episodes fall short (cold steps around rounds, misses, estimates high by chance)
needs a larger predicted gain to speculate.

All of that explores, and exploring costs: the runner charges every decode step the policy
decided, and every plain stretch's shadow upkeep, to the loss ledger (`charge`,
spec/loss_ledger.py): what it cost beyond plain decoding's worth of its tokens. A cost
bucket and sampling mode whose net loss passed 0.5 % of the recent decode time is locked: `choose`
keeps its batches plain, with no probes, shadows or new tables, until the lock ends (a
`locked` decision, which evidence does not end).

Both policies apply the overflow guard: K never exceeds the room left before max_seq_len
(positions n .. n+K must fit) nor the tokens the request may still emit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from infer.spec.costs import CostModel, batch_samples, request_samples
from infer.spec.episodes import GainCalibration
from infer.spec.loss_ledger import LossLedger

__all__ = ["AdaptivePolicy", "CostModel", "FixedPolicy", "SpecPolicy", "best_k", "best_k_for_costs",
           "expected_tokens", "guard_k", "walltime_factor"]


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
    """argmax over K of expected tokens per step / relative step cost r(K) (r(0) = 1), the
    shortest among equals.

    With `margin`, speculating must beat plain decoding by that fraction: near break-even,
    switching back and forth costs more than either choice (the draft must catch up).
    (`choose` asks this for every request whose estimate changed, each step while a batch
    speculates: the expected tokens are summed term by term in one loop, not priced per K,
    x4.05 the speed of pricing each K, side by side on the dev CPU, K up to 5.)
    """
    plain = 1.0 / relative_costs[0]
    best, best_score, tokens, term = 0, plain, 1.0, 1.0
    for k in range(1, len(relative_costs)):
        term *= a
        tokens += term
        score = tokens / relative_costs[k]
        if score > best_score:
            best, best_score = k, score
    return best if best_score > plain * (1.0 + margin) else 0


def _best_by_score(scores: Sequence[float], margin: float) -> int:
    """The K with the highest score (the shortest among equals) if it beats K = 0's by
    `margin`, else 0."""
    best = max(range(len(scores)), key=lambda k: (scores[k], -k))
    return best if scores[best] > scores[0] * (1.0 + margin) else 0


def guard_k(k: int, seq_len: int, max_seq_len: int, tokens_left: int) -> int:
    """Overflow guard: positions seq_len..seq_len+k must fit; no more drafts than can be emitted."""
    return max(0, min(k, max_seq_len - seq_len - 1, tokens_left - 1))


def _could_pay(optimistic: float, typical: float, batch: int, relative_costs: Sequence[float], margin: float) -> int:
    """The K whose round would pay best for a batch of `batch` requests, one of them drafting
    at acceptance `optimistic` and the rest at `typical` (a round costs the whole batch
    r(K)); 0 if none beats plain decoding by `margin`. At batch 1: `best_k_for_costs`."""
    return _best_by_score([(expected_tokens(optimistic, k) + (batch - 1) * expected_tokens(typical, k))
                           / (batch * cost) for k, cost in enumerate(relative_costs)], margin)


class RequestLike(Protocol):
    request_id: str
    num_computed_tokens: int


class SpecPolicy(Protocol):
    def choose(self, requests: Sequence[RequestLike], seq_lens: Sequence[int], max_seq_len: int,
               tokens_left: Sequence[int]) -> list[int]: ...

    def update(self, request_id: str, num_draft: int, num_accepted: int) -> None: ...

    def no_proposal(self, request_id: str) -> bool | None:
        """The proposer had nothing for a request that was given k > 0 (n-gram: no match).
        True if the request was to speculate (not a probe): worth watching for a draft."""
        ...

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

    def no_proposal(self, request_id: str) -> bool | None:
        return None

    def release(self, request_id: str) -> None:
        return None


# a cost table is priced again at once when the episode calibration's factor moves by more
# than this (spec/episodes.py); smaller moves wait for its next refresh
KAPPA_STEP = 0.02


def _one_unit(tokens_behind: int) -> float:
    """Catch-up priced as one unit whatever the gap (proposers without `catch_up_units`)."""
    return 1.0


class _Quiet(NamedTuple):
    """An all-plain decision that holds for the same batch until step `until`."""

    batch: list  # the requests (compared by identity)
    until: int  # first policy step at which something may change (a probe, a cost refresh)
    table: _CostTable
    # CostModel.version when the decision was made (the table's may be older: the refresh
    # gap keeps a table for a while after new measurements, and `until` then ends the
    # decision when the table is due for its refresh)
    version: int
    # the batch's economics overruled requests that would speculate (`_batch_pays`): one
    # request's new evidence does not end it (the whole batch is asked again at `until`)
    vetoed: bool = False
    # id() of each request in `batch` (which keeps them alive): `holds_quiet` runs for every
    # request before a step, and scanning the batch for each was ~1,000 comparisons at 32
    members: frozenset[int] = frozenset()
    sampled: bool = False  # the batch's sampling mode (`batch_samples`)
    # the batch's key is locked by the loss ledger (spec/loss_ledger.py): `until` is the
    # lock's end, and neither evidence nor a finish into another locked key ends it
    locked: bool = False

    @classmethod
    def of(cls, batch: list, until: int, table: _CostTable, version: int, vetoed: bool = False,
           locked: bool = False) -> _Quiet:
        return cls(batch, until, table, version, vetoed, frozenset(map(id, batch)), batch_samples(batch), locked)

    @property
    def firm(self) -> bool:
        """Whether one request's new evidence leaves the decision standing (a vetoed batch is
        asked again at `until` as a whole; a locked one decodes plainly until then)."""
        return self.vetoed or self.locked


@dataclass(slots=True)
class _Asked:
    """The requests the latest `choose` gave k > 0 and that have not drafted yet: if every
    one of them finds nothing (n-gram misses), the batch decodes plainly until `until`."""

    batch: list  # the batch `choose` saw
    pending: set[str]  # ids given k > 0 without a `no_proposal` yet
    until: int  # when something may change: the plain requests' `next_due`, then the misses' backoff
    table: _CostTable
    version: int  # CostModel.version when `choose` asked


class _CostTable(NamedTuple):
    version: int  # CostModel.version it was computed at
    plain_version: int  # CostModel.plain_version it was computed at
    step: int  # policy step it was computed at
    costs: list[float]  # relative costs r(0..k_max) the policy decides with (rounds divided by kappa)
    probe_k: int  # the K a probe drafts
    probe_round: float  # a probe's round in plain steps (its catch-up apart)
    switch: float  # a unit of catch-up work (a draft model: one chunk) in plain steps
    budget: float  # the fraction of the time probes may cost at this batch size
    calibrated_only: bool  # no round's cost is known at this batch size: probes come early
    raw: list[float]  # r(0..k_max) as measured (what an episode's predicted gain is priced with)
    kappa: float  # the episode calibration's factor the costs were divided by
    # the K that would pay best for a batch of the bucket's size with one request at
    # `optimistic_a` and the rest at `batch_acceptance` (0: none would, even then; at batch
    # 1: the K that pays best at `optimistic_a`)
    could_pay: int


class _Choice(NamedTuple):
    """The latest `choose` in which some request speculates (k > 0, not a probe): what
    `episode_gain` prices."""

    table: _CostTable
    estimates: list  # the requests' `_Estimate`s, in batch order
    ks: list[int]


@dataclass(slots=True)
class _Estimate:
    accepted: float
    trials: float  # accepted + rejections (geometric model: each trial accepts with prob a)
    wait_from: int = 0  # policy step since which the request has not drafted
    probe_interval: int = 4
    probing: bool = False  # the round in flight is a probe
    miss_until: int = 0  # after n-gram misses: no asking before this policy step
    miss_interval: int = 0  # steps waited after the latest miss (doubles per miss in a row)
    prior: float = 0.6  # the prior acceptance this request restarts from
    sampled: bool = False  # the request samples at a temperature > 0
    k: int = 0  # best K for this estimate under `table` and `margin` (valid while both are current)
    margin: float = -1.0  # the margin `k` was chosen with
    speculating: bool = False  # the latest choice was k > 0 (not a probe): going on needs `stay_margin`
    credit: float = 0.0  # plain steps probes may still lose, as of policy step `credit_step`
    credit_step: int = -1  # -1: the request's credit is not set yet
    probe_cost: float = 0.0  # the cost of the probe in flight, in plain steps (refunded on a miss)
    drafted: bool = False  # a round has run for this request (so its draft saw its context)
    table: _CostTable | None = None  # None: the estimate changed since k was computed
    # all the evidence, undecayed and never restarted: what the request's drafts accepted
    # (the learned prior is taken from these; the estimate above is reset to the prior
    # by lucky probes, so learning from it would feed a high prior back into itself)
    seen_accepted: float = 0.0
    seen_trials: float = 0.0

    def changed(self) -> None:
        self.table = None

    @property
    def evidence(self) -> bool:
        """A round or a shadow draft has been counted."""
        return self.seen_trials > 0


@dataclass
class AdaptivePolicy:
    k_max: int
    costs: CostModel
    prior_a: float = 0.6
    # a sampled request (temperature > 0) accepts a draft token t with probability p(t) at
    # best, well below a greedy one's exact-match rate on the same text: its prior is lower
    sampled_prior_a: float = 0.3
    prior_weight: float = 4.0
    decay: float = 0.9  # per-round forgetting of old evidence
    max_probe_interval: int = 64
    plain_refresh: int = 256  # every this many steps, one plain step re-measures the baseline
    switch_margin: float = 0.05  # start speculating only when predicted to beat plain by 5 %
    stay_margin: float = 0.0  # go on speculating while predicted to beat plain by this much
    optimistic_a: float = 0.9  # probe only if speculating would pay at this acceptance
    probe_budget: float = 0.01  # probes may cost at most this fraction of the batch's time
    max_probe_spacing: int = 5000  # plain steps; bounds the wait when a cost was misjudged
    min_probe_loss: float = 0.25  # plain steps a probe is counted to lose at least (spacing >= 25)
    # while only calibration prices rounds at a batch size, a probe comes early (to measure
    # them) only if it costs at most this share of the plain steps its request has left: at
    # W2's tail, where the batch enters a new size with few tokens left, early probes with a
    # draft model's whole-context catch-up cost 5-9 ms each (H100 demo pair, ~1-2 % of the
    # workload) and could not have paid whatever they measured
    early_probe_share: float = 0.05
    # tokens the draft is behind -> units of catch-up work (`CostModel.switch_cost` prices
    # one); None: one unit whatever the gap
    catch_up_units: Callable[[int], float] | None = None
    # steps between refreshes of the cost table after plain steps (the plain baseline drifts
    # slowly); each refresh also re-asks a standing all-plain decision, a full `choose` and
    # a step outside a plain stretch (64 cost ~1 % on the H100 demo pair)
    recompute_every: int = 256
    # while rounds are measured (every step when speculating), the cost table is refreshed at
    # most every this many steps: a refresh costs ~30-70 us of host time, most of a round's
    # `choose`, and a median of 8 measurements moves slowly (0: after every measurement)
    refresh_gap: int = 16
    # shadow drafts keep the estimates of plainly decoding requests current (n-gram): a
    # successful probe is then one more round of evidence, not a restart from the prior
    shadowed: bool = False
    # new requests start from what finished ones accepted (per greedy / sampled): the
    # acceptance is mostly a property of the draft and target pair and the traffic, so a
    # request need not re-learn it with probes; `learned_weight` is a finished request's
    # weight in that moving average (0: the fixed priors only). 0.6: one request that
    # speculated through moves the prior most of the way (at 0.3 a 256-token request on the
    # demo pair at T=0, acceptance ~0.94, left it at 0.69, below where K = 5 pays, and the
    # next requests speculated only after a lucky probe: CPU replay min 1.02, median 1.29,
    # against 1.28 and 1.33 at 0.6, fixed K=5 1.34; bad drafts and T=1 unchanged)
    learned_weight: float = 0.6
    learned_full_trials: float = 16.0  # trials of evidence for a request's full weight in it
    # a round costs the whole batch r(K) plain steps, so at batch > 1 speculation must pay
    # for the batch: the expected tokens of all its requests against batch * r(max K)
    # (`_batch_pays`). Requests seldom all draft well at once: what could pay at a batch
    # size is judged with one request at `optimistic_a` and the others at their kind's
    # (learned) prior plus `batch_optimism` (the shadow gate, probes' budget)
    batch_optimism: float = 0.15
    # a batch held plain by its economics is asked again after at most this many steps
    # (each ask is a full `choose` over the batch), doubled after each veto at its batch
    # size and sampling mode since speculation last started there, up to `max_veto_hold`:
    # on the H100 demo pair (draft model, W2-prefix T=0, run 22f) requests
    # that drafted well had a batch of 32 vetoed ~19 times a generation, each ask a full
    # `choose` and two steps outside a plain stretch (~3 % of the workload)
    veto_hold: int = 16
    max_veto_hold: int = 256
    # a batch that starts speculating must repay its drafts' catch-up (`table.switch` per
    # unit, summed over the starting requests: a draft model prefills every starting
    # request's context it skipped) within this many rounds of its expected gain
    switch_horizon: int = 16
    # False: each request decides as if a round were its own, and what could pay is judged
    # for one request (as before the batch's economics; kept for A/B runs)
    batch_economics: bool = True
    # a proposer's per-request state (an n-gram table) is built only where speculation is
    # expected to save this much more than the state costs (`table_pays`)
    table_margin: float = 0.05
    # `table_pays` prices a table at what this batch size's episodes realized (per request of
    # the batch, as before the twenty-first pass; for A/B runs), not at what a drafting
    # request would
    table_by_realized: bool = False
    # realized / predicted gain of speculative episodes per cost bucket and sampling mode
    # (spec/episodes.py): divides the cost of rounds; None: rounds priced as measured
    calibration: GainCalibration | None = field(default_factory=GainCalibration)
    # shadow drafts (and the tables they read) at a cost bucket and sampling mode where no
    # speculation started within this many decode steps that took shadows there
    # (`count_shadowed`) are paused for `shadow_pause` policy steps (`worth_shadowing`):
    # what could pay by the cost table's optimistic premise did not, and their upkeep is all
    # they cost (H100, demo pair, run 20h: n-gram adaptive at W2-prefix T=0 ran no round in
    # 4 instances x 6 generations and read 0.960 of its own plain mode). 0: never paused
    shadow_patience: int = 512
    shadow_pause: int = 4096
    # a proposer whose rows cost next to nothing (n-gram: a lookup; a verification pads every
    # row to the round's width anyway): once a round runs, every request in the batch with
    # evidence (not backing off after a miss) rides along with the round's K, whatever its
    # own estimate (`_add_riders`), and the batch's economics count what riders are expected to
    # emit. Without riders a round at W2 on the demo pair (H100, T=0) drafted for 10-13 of
    # 22-29 requests (run 20h) where fixed K=5, every row drafting, beat plain decoding by 10 %
    riders: bool = False
    # shadowed: a request without evidence yet starts at its kind's learned prior (`_learned`)
    # where that prior alone would have it speculate; else it waits for its first shadow draft
    learned_start: bool = True
    # what exploring speculation lost against plain decoding, net, per cost bucket and
    # sampling mode (`charge`, spec/loss_ledger.py): a key that lost more than its budget
    # decodes plainly, exploring nothing, for a while. None: no such bound
    ledger: LossLedger | None = field(default_factory=LossLedger)
    _est: dict[str, _Estimate] = field(default_factory=dict)
    _learned: dict[bool, float] = field(default_factory=dict)  # sampled -> learned prior acceptance
    _steps: int = 0
    _table: dict[tuple[int, bool], _CostTable] = field(default_factory=dict)  # by (bucket, batch samples)
    _quiet: _Quiet | None = None
    # (bucket, batch samples) -> vetoes since speculation last started there (`veto_hold`
    # doubles with each; kept across batches: each W2 generation's new batch of 32 at the
    # learned prior was vetoed 3-4 times again from a hold of 16, H100 draft model at
    # W2-prefix T=0, run 23f: ~1 % of the workload)
    _vetoes: dict[tuple[int, bool], int] = field(default_factory=dict)
    _asked: _Asked | None = None
    _choice: _Choice | None = None
    # (bucket, batch samples) -> decode steps that took shadows there since speculation last
    # started there (or since a pause), and the policy step until which they are paused
    _shadowed_steps: dict[tuple[int, bool], int] = field(default_factory=dict)
    _shadows_paused: dict[tuple[int, bool], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"spec_length must be >= 1, got {self.k_max}")
        for name in ("prior_a", "sampled_prior_a"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if not self.stay_margin <= self.switch_margin:
            raise ValueError(f"stay_margin ({self.stay_margin}) must not exceed switch_margin ({self.switch_margin})")
        if not 0.0 <= self.learned_weight <= 1.0:
            raise ValueError(f"learned_weight must be in [0, 1], got {self.learned_weight}")
        if self.refresh_gap < 0:
            raise ValueError(f"refresh_gap must be >= 0, got {self.refresh_gap}")
        if not 0.0 <= self.batch_optimism < 1.0:
            raise ValueError(f"batch_optimism must be in [0, 1), got {self.batch_optimism}")
        if not 1 <= self.veto_hold <= self.max_veto_hold:
            raise ValueError(f"need 1 <= veto_hold <= max_veto_hold, got {self.veto_hold} and {self.max_veto_hold}")
        if self.switch_horizon < 1:
            raise ValueError(f"switch_horizon must be >= 1, got {self.switch_horizon}")
        if self.learned_full_trials <= 0:
            raise ValueError(f"learned_full_trials must be > 0, got {self.learned_full_trials}")
        if not 0.0 <= self.early_probe_share <= 1.0:
            raise ValueError(f"early_probe_share must be in [0, 1], got {self.early_probe_share}")
        if self.table_margin < 0:
            raise ValueError(f"table_margin must be >= 0, got {self.table_margin}")
        if self.shadow_patience < 0 or self.shadow_pause < 0:
            raise ValueError(f"shadow_patience and shadow_pause must be >= 0, got {self.shadow_patience} "
                             f"and {self.shadow_pause}")

    def acceptance(self, request_id: str) -> float:
        """The request's acceptance estimate; a greedy request's prior if it has none yet."""
        e = self._est.get(request_id)
        return self.prior(False) if e is None else e.accepted / e.trials

    def prior(self, sampled: bool) -> float:
        """The acceptance a new request starts from: learned from finished requests of its
        kind (greedy or sampled), else `prior_a` / `sampled_prior_a`."""
        return self._learned.get(sampled, self.sampled_prior_a if sampled else self.prior_a)

    def choose(self, requests: Sequence[RequestLike], seq_lens: Sequence[int], max_seq_len: int,
               tokens_left: Sequence[int]) -> list[int]:
        # this runs before every decode step, mostly to answer "plain again": an all-plain
        # answer holds for the same batch until the next probe or cost refresh is due, and
        # the best K per estimate is cached until the estimate or the cost table changes
        batch = len(requests)
        if self.quiet(requests):
            return [0] * batch
        self._steps += 1
        was_speculating = self._choice is not None  # the latest full choice had rounds going on
        self._quiet = self._asked = self._choice = None
        sampled = batch_samples(requests)
        table = self._cost_table(batch, sampled)
        if table is None or self._steps % self.plain_refresh == 0:
            return [0] * batch  # measure (or re-measure) a plain step at this batch size
        until = self._lock_end(batch, sampled)
        if until is not None:  # exploring lost more than its budget here: plain until the lock ends
            self._quiet = _Quiet.of(list(requests), until, table, self.costs.version, locked=True)
            return [0] * batch
        ks: list[int] = []
        ests: list[_Estimate] = []
        probers: list[_Estimate] = []  # requests probing at this step
        starting = False
        next_due = table.step + self.recompute_every
        if next_due <= self._steps:
            # a table older than that, kept because nothing was measured since: decide again
            # after the refresh gap (by then a timed plain step may have renewed it), not at
            # every step (a decision already out of date held for none, and each step asked
            # `choose` in full)
            next_due = self._steps + max(1, self.refresh_gap)
        if table.version != self.costs.version:  # kept by the refresh gap: decide again at its refresh
            next_due = min(next_due, table.step + self.refresh_gap)
        wants: list[int] = []  # per request: the K it would speculate with (0: none; -1: not even a probe)
        for r in requests:
            est = self._est.get(r.request_id) or self._lookup(r.request_id, request_samples(r))
            ests.append(est)
            if self.shadowed and not est.evidence:
                # the first shadow draft decides, unless finished requests of its kind taught a
                # prior at which it would speculate (`learned_start`): their rate is the best
                # guess, and waiting for a table and a shadow kept half a batch of 32 plain
                # (and the batch's round vetoed) for ~100 steps at W2 T=0 (H100, run 21c)
                learned, k = self._learned_start(est, table)
                if not k or self._steps < est.miss_until:
                    wants.append(-1)
                    continue
                if est.prior != learned:  # (no evidence: the estimate is its prior alone)
                    est.prior, est.accepted, est.trials = learned, learned * self.prior_weight, self.prior_weight
                    est.changed()
                wants.append(k)
                continue
            # hysteresis: starting to speculate must beat plain decoding by `switch_margin`
            # (switching costs: the draft catches up, the first round after plain steps is
            # dearer), going on only by `stay_margin`; one threshold would flap near it
            margin = self.stay_margin if est.speculating else self.switch_margin
            if est.table is not table or est.margin != margin:
                est.k = best_k_for_costs(est.accepted / est.trials, table.costs, margin)
                est.table, est.margin = table, margin
            k = est.k
            est.speculating = k > 0
            if k and self._steps < est.miss_until:  # backing off after misses
                est.speculating = False
                next_due = min(next_due, est.miss_until)
                wants.append(-1)
                continue
            wants.append(k)
        vetoed = False
        if self.batch_economics and batch > 1 and max(wants) > 0:
            top = max(wants)  # (riders draft the round's K, counted here at their own estimates)
            guarded = [guard_k(k if k > 0 else top if self._rides(e, k) else 0, n, max_seq_len, left)
                       for e, k, n, left in zip(ests, wants, seq_lens, tokens_left, strict=True)]
            if any(guarded) and not self._batch_pays(ests, guarded, table, was_speculating, seq_lens):
                # the round would cost the batch more than its drafts bring: the requests that
                # were to speculate decode plainly, and may probe as plain ones do (else one
                # vetoed without evidence would wait for evidence that never comes)
                vetoed = True
                for i, k in enumerate(wants):
                    if k > 0:
                        wants[i], ests[i].speculating = 0, False
                key = (self.costs.bucket(batch), sampled)
                vetoes = self._vetoes.get(key, 0)
                next_due = min(next_due, self._steps + min(self.veto_hold << vetoes, self.max_veto_hold))
                self._vetoes[key] = min(vetoes + 1, self.max_veto_hold.bit_length())
        for est, k, n, left in zip(ests, wants, seq_lens, tokens_left, strict=True):
            if k < 0:
                ks.append(0)
                continue
            if k == 0:
                # the draft must first catch up on what it has not seen: the whole context
                # before the request's first round, else the tokens of the plain steps since
                behind = self._steps - est.wait_from if est.drafted else n
                cost = table.probe_round + table.switch * (self.catch_up_units or _one_unit)(behind)
                loss = self._probe_loss(est, table, cost)
                due = self._probe_due(est, table, left, cost, loss)
                if self._steps < due:
                    next_due = min(next_due, due)
                    ks.append(0)
                    continue
                # charged as if it emitted only its bonus token; `update` refunds the rest
                est.credit = self._credit(est, table, loss) - (cost - 1.0)
                est.credit_step = max(self._steps, est.credit_step)
                est.probing, k, est.probe_cost = True, table.probe_k, cost
                probers.append(est)
            est.wait_from = self._steps
            k = guard_k(k, n, max_seq_len, left)
            starting = starting or (k > 0 and not est.probing)
            ks.append(k)
        if len(probers) > 1 and table.probe_round > 1.0:
            # probes in one step share it: the batch pays one round, so each prober is charged
            # its share of the round and its own catch-up, the rest refunded
            for est in probers:
                refund = (table.probe_round - 1.0) * (1.0 - 1.0 / len(probers))
                est.credit += refund
                est.probe_cost -= refund
        if self.riders and any(ks):
            self._add_riders(ests, wants, ks, seq_lens, max_seq_len, tokens_left)
        if not any(ks):
            self._quiet = _Quiet.of(list(requests), next_due, table, self.costs.version, vetoed)
        else:
            self._asked = _Asked(list(requests), {r.request_id for r, k in zip(requests, ks) if k}, next_due, table,
                                 self.costs.version)
            if starting:
                self._choice = _Choice(table, ests, ks)
                self._vetoes.pop((self.costs.bucket(batch), sampled), None)  # the holds start over
        return ks

    def started(self, batch_size: int, sampled: bool) -> None:
        """Speculation started at this batch size and sampling mode with a round that verified
        drafts (the runner: a step that opened an episode drafted): shadow drafts there earn
        their patience anew, and a pause of theirs ends. Not a choice that started
        speculating and whose lookups all missed: at W2 each generation's first choice (32
        requests at their learned prior, n-gram tables not built) did, and shadows at batch
        32 never paused (H100 demo target, W2-prefix T=0: ~60 us a step, 3 % of the
        workload, run 23d)."""
        key = (self.costs.bucket(batch_size), sampled)
        if key in self._shadowed_steps:
            self._shadowed_steps[key] = 0
            self._shadows_paused.pop(key, None)

    def charge(self, batch_size: int, sampled: bool, lost: float, plain: float | None = None) -> None:
        """A decode step of a batch of this size and sampling mode (or a plain stretch's
        upkeep) cost `lost` seconds more than plain decoding would have for its tokens
        (negative: it saved that much): the loss ledger's account (spec/loss_ledger.py),
        the steps since the previous charge elapsed at this batch size's plain step
        (`plain` seconds, if the caller has it at hand)."""
        ledger = self.ledger
        if ledger is None:
            return
        if plain is None:
            plain = self.costs.step_seconds(batch_size, 0, sampled)
        if plain is not None:
            ledger.charge((self.costs.bucket(batch_size), sampled), lost, self._steps, plain)

    def _lock_end(self, batch_size: int, sampled: bool) -> int | None:
        """The policy step at which the loss ledger's lock of this batch size and sampling mode
        ends, if it has them decode plainly now (else None)."""
        ledger = self.ledger
        key = (self.costs.bucket(batch_size), sampled)
        return ledger.lock_end(key) if ledger is not None and ledger.locked(key, self._steps) else None

    def _learned_start(self, est: _Estimate, table: _CostTable) -> tuple[float | None, int]:
        """For a shadowed request without evidence: its kind's learned prior (None: none
        learned, or `learned_start` off) and the K that prior alone would start with under
        `table` by the switch margin (0: it waits for its first shadow draft)."""
        learned = self._learned.get(est.sampled) if self.learned_start else None
        return learned, 0 if learned is None else best_k_for_costs(learned, table.costs, self.switch_margin)

    def _rides(self, est: _Estimate, want: int) -> bool:
        """Whether a request may ride along in a round (`riders`): it would decode plainly
        (`want` 0: not -1, which waits for evidence or a miss backoff) and is not backing
        off after a miss."""
        return self.riders and want == 0 and self._steps >= est.miss_until

    def _add_riders(self, ests: Sequence[_Estimate], wants: Sequence[int], ks: list[int], seq_lens: Sequence[int],
                    max_seq_len: int, tokens_left: Sequence[int]) -> None:
        """A round runs (some k > 0): every request that may ride (`_rides`) and does not
        probe drafts the round's longest K too, within its overflow guard. Its drafts cost a
        lookup, and the verification is padded to the round's width for every row anyway:
        they can only add tokens. A rider is no probe (no credit moves) and no choice to
        speculate (`speculating` stays False: it needs the switch margin on its own estimate
        to start)."""
        top = max(ks)
        for i, (est, want) in enumerate(zip(ests, wants, strict=True)):
            if not ks[i] and self._rides(est, want):
                ks[i] = guard_k(top, seq_lens[i], max_seq_len, tokens_left[i])
                if ks[i]:
                    est.wait_from = self._steps

    def worth_shadowing(self, batch_size: int, sampled: bool) -> bool:
        """Whether shadow drafts can change anything for a batch of this size and sampling
        mode: False once its cost table says no K would pay, by the switch margin and their
        measured upkeep (`CostModel.upkeep`), even with one request at `optimistic_a` and the
        rest at `batch_acceptance` (rounds divided by kappa), where
        evidence of acceptance cannot make the batch speculate and the n-gram tables' upkeep
        (a few us a token of Python) is pure cost: on the H100 demo target at batch 32, 5-10 %
        of a step, and building the tables of 32 prompts at prefill ~25 ms (H200, run 15a).
        A table dropped since (kappa moved) is priced again; True while no plain step's cost
        is known there.

        That premise is optimistic: where shadows ran for `shadow_patience` decode steps
        without speculation starting at this bucket and mode, they are paused for
        `shadow_pause` policy steps (`count_shadowed`; then tried again, patience anew);
        speculation starting there with a verified round (`started`) restarts the patience
        and ends a pause."""
        key = (self.costs.bucket(batch_size), sampled)
        if self._steps < self._shadows_paused.get(key, -1) or self._lock_end(batch_size, sampled) is not None:
            return False
        table = self._table.get(key)
        if table is None:  # (dropped when kappa moved: priced again here, not taken as unknown)
            table = self._cost_table(batch_size, sampled)
        return table is None or table.could_pay > 0

    def count_shadowed(self, batch_size: int, sampled: bool, steps: int) -> None:
        """`steps` decode steps at this batch size and sampling mode took shadow drafts (plain
        steps and their tables' upkeep, and the shadows a round takes): past
        `shadow_patience` of them without speculation starting there, shadows pause there
        for `shadow_pause` policy steps."""
        key = (self.costs.bucket(batch_size), sampled)
        count = self._shadowed_steps[key] = self._shadowed_steps.get(key, 0) + steps
        if self.shadow_patience and count > self.shadow_patience:
            self._shadows_paused[key] = self._steps + self.shadow_pause
            self._shadowed_steps[key] = 0

    def table_pays(self, batch_size: int, sampled: bool, tokens_left: int, index_tokens: int,
                   seconds_per_token: float) -> bool:
        """Whether a proposer's per-request state (an n-gram table) is worth building for a
        request in a batch of `batch_size` that may emit `tokens_left` more tokens: building
        it costs `seconds_per_token` for each of its `index_tokens` tokens and each token it
        then follows; speculating saves, per emitted token, a plain step's share of the batch
        times 1 - 1 / rate. The rate (tokens per plain step's time) is what a drafting request
        would realize: the best any K gives at `batch_acceptance` with the cost table's rounds
        (kappa applied: episodes that fell short price them up; the premise of the shadow
        gate, `worth_shadowing`). True, by `table_margin`, when the saving covers the cost,
        and while no plain step's cost is known there.

        Why: at W2 on the demo pair (H100, n-gram, T=0) rounds at batch 32 about broke even
        and the tables cost ~3.5 us a token, prompt and output, host time a step could not
        hide: ~10 % of the workload's time. A table for a request with 100 tokens left at
        batch 16-32 costs more than its speculation could save; at batch 1 it costs ~1 % of
        what it saves. The rate was once what this batch size's episodes realized
        (`GainCalibration.rate`; `table_by_realized` brings it back): a rate per request of
        the batch, rows without a table (one token a round) included, so where few had one
        it fell toward 1 and no request got one; at W2 T=0 `admit` then refused a table to
        32 of 32 requests at batch 32 (H100, run 21e) where fixed K=5, every row drafting,
        ran at 1.10-1.31x plain decoding (21b, 21d)."""
        if self._lock_end(batch_size, sampled) is not None:
            return False
        plain = self.costs.step_seconds(batch_size, 0, sampled)
        if plain is None:
            return True
        key = (self.costs.bucket(batch_size), sampled)
        rate = (self.calibration.rate(key) if self.calibration is not None and self.table_by_realized
                else None)
        if rate is None:
            table = self._cost_table(batch_size, sampled)
            if table is None:
                return True
            a = self.batch_acceptance(sampled)
            k = best_k_for_costs(a, table.costs)  # (0: no K beats plain decoding, rate 1)
            rate = expected_tokens(a, k) / table.costs[k]
        saving = tokens_left * plain / batch_size * (1.0 - 1.0 / rate) if rate > 1.0 else 0.0
        return saving > (index_tokens + tokens_left) * seconds_per_token * (1.0 + self.table_margin)

    def _batch_pays(self, ests: Sequence[_Estimate], ks: Sequence[int], table: _CostTable,
                    speculating: bool, seq_lens: Sequence[int]) -> bool:
        """Whether a round with these drafts beats a plain step for the whole batch: its
        requests' expected tokens (one for those without drafts) against batch * r(max K),
        by `stay_margin` if the batch was speculating, else by `switch_margin`, and then
        its gain over `switch_horizon` rounds must also repay the catch-up of the requests
        that start (`table.switch` per unit, summed over them: the whole context for a
        draft that never saw it; batched, but a chunk forward's cost grows with its rows).
        Without that, the draft model at W2 on the demo pair (H100, T=0) started 32
        requests at k = 1 on a predicted gain of 4 %: the batched catch-up of their prompts
        took 28 ms, ~13 plain steps."""
        tokens = sum(expected_tokens(e.accepted / e.trials, k) if k else 1.0 for e, k in zip(ests, ks, strict=True))
        batch = len(ks)
        margin = self.stay_margin if speculating else self.switch_margin
        gain = tokens - batch * table.costs[max(ks)] * (1.0 + margin)
        if gain <= 0.0 or speculating or not table.switch:
            return gain > 0.0
        units = self.catch_up_units or _one_unit
        behind = sum(units(self._steps - e.wait_from if e.drafted else n)
                     for e, k, n in zip(ests, ks, seq_lens, strict=True) if k)
        return gain * self.switch_horizon > batch * table.switch * behind

    def batch_acceptance(self, sampled: bool) -> float:
        """The acceptance most requests of a batch might reach (what could pay is judged with
        it): their kind's prior (`prior`, learned from finished requests) plus
        `batch_optimism`, at most `optimistic_a`."""
        return min(self.optimistic_a, self.prior(sampled) + self.batch_optimism)

    def episode_gain(self) -> float | None:
        """After a `choose` that has some request speculate (k > 0, not a probe): the step's
        expected tokens per request per plain step's time, priced with the measured costs
        (not kappa): the prediction a speculative episode starting here is held to
        (spec/episodes.py). None otherwise."""
        choice = self._choice
        if choice is None:
            return None
        tokens = sum(expected_tokens(e.accepted / e.trials, k) for e, k in zip(choice.estimates, choice.ks))
        return tokens / (len(choice.ks) * choice.table.raw[max(choice.ks)])

    def observe_episode(self, batch_size: int, sampled: bool, plain_steps: float, realized: float,
                        predicted: float) -> None:
        """A speculative episode (spec/episodes.py) ended: `plain_steps` plain steps' time,
        `realized` tokens per request emitted where `predicted` were expected. Moves the
        mode's kappa. Its cost table is priced afresh at the next `choose` only if kappa
        moved by more than `KAPPA_STEP` since (else at its next refresh: pricing a table
        cost the next round ~40-100 us of `choose` on the H100, after every episode)."""
        if self.calibration is None:
            return
        key = (self.costs.bucket(batch_size), sampled)
        self.calibration.observe(key, plain_steps, realized, predicted)
        table = self._table.get(key)
        if table is not None and abs(self.calibration.factor(key) - table.kappa) > KAPPA_STEP:
            del self._table[key]

    def quiet(self, requests: Sequence[RequestLike]) -> bool:
        """Whether a standing all-plain decision holds for this batch at this step. If so the
        step is counted, as `choose` would, and the caller may skip `choose` (the runner's
        thin path for plain steps: no per-request lists built)."""
        quiet = self._quiet
        if (quiet is not None and self._steps + 1 < quiet.until and quiet.version == self.costs.version
                and requests == quiet.batch):
            self._steps += 1
            return True
        return False

    def holds_quiet(self, request: RequestLike) -> bool:
        """Whether the standing all-plain decision covers `request` at the next step (read
        before it, changing nothing): the runner then reserves one cache position for the
        request, in the target's cache only, as plain decoding does. If the batch then is
        not the decision's (`quiet` fails), the runner must decode that step plainly and
        `end_quiet`."""
        quiet = self._quiet
        return (quiet is not None and self._steps + 1 < quiet.until and quiet.version == self.costs.version
                and id(request) in quiet.members)

    def quiet_steps_left(self) -> int:
        """Steps after this one for which the standing all-plain decision holds for the same
        batch (0 if none stands): the runner may decode them without asking `quiet`, then
        `count_quiet_steps`."""
        quiet = self._quiet
        return 0 if quiet is None else max(0, quiet.until - 1 - self._steps)

    def count_quiet_steps(self, steps: int) -> None:
        """Count `steps` plain steps decoded under the standing decision without `quiet`."""
        self._steps += steps

    def end_quiet(self) -> None:
        """Drop the standing all-plain decision (the batch changed under it)."""
        self._quiet = None

    def keep_quiet_without(self, request: RequestLike) -> bool:
        """`request` leaves the batch (finished, preempted, aborted) under a standing all-plain
        decision: True when the decision holds for the rest as it stands, which then is its
        batch. It does where the rest keep the sampling mode and either the cost bucket (the
        same table: a batch its economics held plain (`vetoed`) is asked again at `until` as
        planned, its economics changed by one request in the bucket's size; asked at each
        finish, it took ~10 full choices a generation at batch 17-32, H100, draft model,
        W2-prefix T=0, run 22i) or, where nobody wanted to speculate, a smaller bucket under
        whose table none of them would start (`_might_start`; none can where no K could pay
        even with one request at `optimistic_a`, `could_pay` 0). Else False, and the
        decision stays as it was: the runner `end_quiet`s it at once for a finish (nobody
        has reserved the next step yet), and otherwise (a preemption while the scheduler
        reserves: requests may hold one position already) decodes the next step plainly and
        ends it then. Saves a full `choose` and steps
        outside a plain stretch after each finish: ~100-300 us each at batch 32 (H200, W2
        ledgers), 31 finishes a generation; a bucket change cost three such steps (H100, W2,
        runs 22c-22d: ~20 a generation, 1-2 % of it). Where the rest's bucket is locked by
        the loss ledger the decision holds for them until that lock ends (a `locked` one,
        whatever it was); a locked decision whose rest falls into an open key does not."""
        quiet = self._quiet
        if quiet is None or id(request) not in quiet.members:
            return False
        rest = [r for r in quiet.batch if r is not request]
        # the rest keep the batch's sampling mode unless the one leaving was its only sampler
        # (scanning the rest only then: this runs at every finish)
        sampled = batch_samples(rest) if request_samples(request) else quiet.sampled
        if not rest or sampled != quiet.sampled:
            return False
        table, until, locked = quiet.table, quiet.until, quiet.locked
        if self.costs.bucket(len(rest)) != self.costs.bucket(len(quiet.batch)):
            # the rest's key locked by the loss ledger: plain until its lock ends, whatever
            # the decision was (a locked one into an unlocked key: decided afresh)
            lock_end = self._lock_end(len(rest), sampled)
            locked = lock_end is not None
            if not locked and (quiet.vetoed or quiet.locked):
                return False
            table = self._cost_table(len(rest), sampled)
            if table is None or (not locked and table.could_pay and any(self._might_start(r, table) for r in rest)):
                return False
            if lock_end is not None:
                until = lock_end
        self._quiet = quiet._replace(batch=rest, members=quiet.members - {id(request)}, table=table, until=until,
                                     locked=locked)
        return True

    def _might_start(self, request: RequestLike, table: _CostTable) -> bool:
        """Whether `choose` under `table` might have `request` speculate now (a bucket change
        under a standing plain decision, `keep_quiet_without`): its estimate would start by
        the switch margin (one without evidence yet, shadowed: its kind's learned prior, as
        `learned_start`); a request backing off after a miss, or without an estimate, might."""
        est = self._est.get(request.request_id)
        if est is None or self._steps < est.miss_until:
            return True
        if self.shadowed and not est.evidence:
            return self._learned_start(est, table)[1] > 0
        return self._would_start(est, table)

    def _cost_table(self, batch_size: int, sampled: bool = False) -> _CostTable | None:
        """Relative costs and probe spacing at this batch size and sampling mode (`sampled`:
        the batch samples, spec/costs.py); None until a plain step's cost is known there.
        Cached: recomputed when a speculative step or a switch was measured, or every
        `recompute_every` steps while only plain steps were (the plain baseline drifts
        slowly), but at most every `refresh_gap` steps once a round's cost is known (while
        speculating, every round is measured, and the table took most of a `choose`)."""
        b = (self.costs.bucket(batch_size), sampled)
        t = self._table.get(b)
        model = self.costs
        if t is not None:
            age = self._steps - t.step
            # (a table priced from calibration alone is replaced as soon as a round is measured)
            if ((t.version == model.version or (age < self.refresh_gap and not t.calibrated_only))
                    and (t.plain_version == model.plain_version or age < self.recompute_every)):
                return t
        if not model.has_plain(batch_size, sampled):
            return None
        raw = self.costs.relative_costs(batch_size, sampled)
        # rounds cost what episodes showed beyond the measured steps (spec/episodes.py),
        # their evidence relaxing toward the prior meanwhile (a mode a low kappa locked out)
        kappa = 1.0
        if self.calibration is not None:
            self.calibration.relax(b, self._steps)
            kappa = self.calibration.factor(b)
        costs = raw if kappa == 1.0 else [1.0] + [x / kappa for x in raw[1:]]
        # probe with the K that would pay best at the optimistic acceptance (for the batch: one
        # request at it, the rest at `batch_acceptance`): one round then
        # tells as much as K probes of one token, at little more than one's cost (a round's
        # host overhead is most of it); K = 1 when nothing could pay (then probes only
        # re-measure the costs), or when shadow drafts measure the acceptance anyway
        # shadow drafts and table upkeep cost every plain step (`CostModel.upkeep`): what could
        # pay must also pay for them
        upkeep = self.costs.upkeep(batch_size, sampled) if self.batch_economics else 0.0
        could_pay = _could_pay(self.optimistic_a, self.batch_acceptance(sampled), b[0] if self.batch_economics else 1,
                               costs, (1.0 + self.switch_margin) * (1.0 + upkeep) - 1.0)
        # a tenth of the budget for probes that can only re-measure the costs: nothing could
        # pay, or shadow drafts measure the acceptance (for free)
        budget = self.probe_budget if could_pay and not self.shadowed else self.probe_budget / 10
        # shared by the batch's requests (a probe's round is the whole batch's step)
        budget /= b[0]
        probe_k = 1 if self.shadowed or not could_pay else could_pay
        t = self._table[b] = _CostTable(self.costs.version, self.costs.plain_version, self._steps, costs, probe_k,
                                        costs[probe_k], self.costs.switch_cost(batch_size, sampled), budget,
                                        not self.costs.has_round(batch_size, sampled), raw, kappa, could_pay)
        return t

    def _credit(self, est: _Estimate, table: _CostTable, cap: float) -> float:
        """The request's probe credit now: it accrues `table.budget` plain steps per step from
        `credit_step` on, up to `cap` (one probe's expected loss: no bursts of probes after
        a long wait)."""
        if est.credit >= cap or self._steps <= est.credit_step:
            return est.credit
        return min(cap, est.credit + table.budget * (self._steps - est.credit_step))

    def _probe_loss(self, est: _Estimate, table: _CostTable, cost: float) -> float:
        """What a probe costing `cost` plain steps is expected to lose against plain decoding:
        its cost less the tokens it is expected to emit at the request's estimate (at
        acceptance 0 for shadowed requests, whose estimate comes from shadow drafts and is no
        reason to probe); at least `min_probe_loss`."""
        a = 0.0 if self.shadowed else est.accepted / est.trials
        return max(self.min_probe_loss, cost - expected_tokens(a, table.probe_k))

    def _probe_due(self, est: _Estimate, table: _CostTable, tokens_left: int, cost: float, loss: float) -> int:
        """The policy step at which a request decoding plainly probes next; `cost`: the
        probe's, its round and the draft's catch-up (plain steps), `loss`: `_probe_loss`.

        Probes are paid from a credit that accrues at the budget (1 % of the time, or 0.1 %
        when no K would beat plain decoding even at the optimistic acceptance: such probes
        only re-measure the costs, which may have changed or been misjudged) and pays for
        each probe what it lost against plain decoding: its cost less the tokens it emitted.
        A probe is due once the credit covers its expected loss. A probe that pays for itself
        (high acceptance) costs nothing, so the next comes soon and evidence adds up; drafts
        that fail drain the credit and probes grow rare.

        A new greedy request gets the budget of the tokens it may still emit in advance (at
        most one probe's cost); its credit accrues again once the budget has earned the
        advance. Its first probe comes early unless the prior acceptance says it would lose
        more (a long prompt's catch-up costs more), so that speculation can start while most
        of the request is ahead. A sampled request (it accepts a draft token t only with
        probability p(t): on the demo pair at T=1, early probes cost 3-5 %, H100 run MMM) and
        a shadowed one (its estimate comes from shadow drafts) get no advance.

        While only calibration prices rounds here (`calibrated_only`), the probe comes as soon
        as the request's backoff allows, to measure them, if it costs at most
        `early_probe_share` of the plain steps the request has left."""
        if est.credit_step < 0:
            advance = 0.0 if self.shadowed or est.sampled else min(table.budget * tokens_left, cost)
            est.credit, est.credit_step = advance, self._steps + math.ceil(advance / table.budget)
        first = est.wait_from + est.probe_interval
        if table.calibrated_only and cost <= self.early_probe_share * tokens_left:
            return first  # real measurements replace the calibration (or stale ones) soon
        need = loss - self._credit(est, table, loss)
        due = max(self._steps, est.credit_step) + math.ceil(need / table.budget) if need > 0 else self._steps
        return max(first, min(due, est.wait_from + self.max_probe_spacing))

    def update(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        est = self._estimate(request_id)
        probing, est.probing = est.probing, False
        if probing:  # a probe costs its cost less the tokens it emitted: refund the accepted ones
            est.credit += num_accepted
        est.drafted = True
        if probing and num_accepted > 0 and not self.shadowed and est.accepted < est.prior * est.trials:
            # the text changed since speculation stopped paying: start over from the prior
            # (a fluke costs a few rounds; keeping the old evidence would take many probes).
            # An estimate at or above the prior keeps its evidence: probes then add up
            self._restart(est)
            est.probe_interval = 4
        self._count(est, num_draft, num_accepted)
        if probing and num_accepted == 0:  # a failed probe: wait longer next time
            est.probe_interval = min(est.probe_interval * 2, self.max_probe_interval)
        elif num_accepted > 0:
            est.probe_interval = 4
        est.miss_interval = 0  # the proposer had something: ask every step again

    def observe_shadow(self, request_id: str, num_draft: int, num_matched: int) -> None:
        """A shadow draft (spec/shadow.py) matched `num_matched` of its `num_draft` tokens:
        the same evidence as a round that accepted as many, at no verification cost. A
        whole draft matched (by chance only with probability prod p(t_i)) says the text has
        turned repetitive: a low estimate restarts from the prior, as after a probe without
        shadows."""
        est = self._lookup(request_id)
        est.changed()
        restart = num_matched == num_draft > 1 and est.accepted < est.prior * est.trials
        if restart:
            self._restart(est)
        self._count(est, num_draft, num_matched)  # (the miss backoff is about real asks: it stays)
        # a standing all-plain decision holds unless this evidence makes the request speculate
        # (a shadowed request's probes are priced at acceptance 0: their schedule stays), which
        # a request waiting after a miss does not (`proposal_ready` ends the wait)
        quiet = self._quiet
        if quiet is not None and not quiet.firm and self._steps >= est.miss_until and (
                restart or not self.shadowed or self._would_start(est, quiet.table)):
            self._quiet = None

    def _would_start(self, est: _Estimate, table: _CostTable) -> bool:
        """Whether the request's estimate would have it start speculating under `table` (by
        the switch margin): what ends a standing all-plain decision on new evidence."""
        return best_k_for_costs(est.accepted / est.trials, table.costs, self.switch_margin) > 0

    def _restart(self, est: _Estimate) -> None:
        """Drop the evidence: back to the prior acceptance at the prior's weight."""
        est.accepted, est.trials = est.prior * self.prior_weight, self.prior_weight

    def _count(self, est: _Estimate, num_draft: int, num_accepted: int) -> None:
        """Decay the old evidence, add a round: accepted tokens, and a rejection unless all were."""
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        est.accepted = est.accepted * self.decay + num_accepted
        est.trials = est.trials * self.decay + trials
        est.seen_accepted += num_accepted
        est.seen_trials += trials

    def no_proposal(self, request_id: str) -> bool:
        """The proposer had nothing (an n-gram miss): wait 2, 4, 8 ... steps before asking
        again. The acceptance estimate stays: a miss drafts nothing, so it is not a rejection.
        Returns whether the request is worth watching (shadowed: `proposal_ready`): it was
        to speculate. A probe's miss is not: its estimate would keep it plain when found, so
        the watch's lookups at every step for up to 64 steps would buy nothing."""
        est = self._lookup(request_id)
        probing, est.probing = est.probing, False
        if probing:  # no draft, no round: the probe cost a lookup, not its charge
            est.credit += est.probe_cost - 1.0
        # (shadowed: the runner watches the request and calls `proposal_ready`; for a sampled
        # request the backoff only bounds the wait: its found lookups are asked at once, and
        # asking on a schedule mostly misses; a greedy one keeps its short backoff, the watch
        # ending it early: on a code edit at T=0 asking again 2 steps after a miss catches the
        # next repeat sooner, CPU replay W5 T=0 1.73 with the long wait, 2.00 with both)
        est.miss_interval = (self.max_probe_interval if self.shadowed and est.sampled
                             else min(max(2, est.miss_interval * 2), self.max_probe_interval))
        est.miss_until = self._steps + est.miss_interval
        if probing:
            est.probe_interval = min(est.probe_interval * 2, self.max_probe_interval)
        self._quiet = None
        asked = self._asked
        if asked is not None and request_id in asked.pending:
            asked.pending.discard(request_id)
            asked.until = min(asked.until, est.miss_until)
            if not asked.pending:
                # nobody drafted: the whole batch decodes plainly, as `choose` would decide at
                # the next step (the misses back off, the rest were plain), without asking it
                self._quiet, self._asked = _Quiet.of(asked.batch, asked.until, asked.table, asked.version), None
        return not probing

    def proposal_ready(self, request_id: str) -> None:
        """A request that missed was looked up under a plain step's forward, and the step
        emitted its draft's first token (`ShadowDrafts.watch`): the proposer most likely has
        a draft at the next step. The miss backoff ends, and so does a standing all-plain
        decision if the request would speculate."""
        est = self._est.get(request_id)
        if est is None:
            return
        est.miss_until = est.miss_interval = 0
        quiet = self._quiet
        if quiet is not None and not quiet.firm and self._would_start(est, quiet.table):
            self._quiet = None

    def _prior(self, sampled: bool) -> _Estimate:
        a = self.prior(sampled)
        return _Estimate(a * self.prior_weight, self.prior_weight, wait_from=self._steps, prior=a, sampled=sampled)

    def _lookup(self, request_id: str, sampled: bool = False) -> _Estimate:
        """The request's estimate; a new one starts from the prior (`sampled`: the request
        samples with a temperature > 0, so its prior is `sampled_prior_a`)."""
        est = self._est.get(request_id)
        if est is None:
            est = self._est[request_id] = self._prior(sampled)
        return est

    def _estimate(self, request_id: str) -> _Estimate:
        """The request's estimate, about to change (its cached best K is dropped)."""
        est = self._lookup(request_id)
        est.changed()
        self._quiet = None
        return est

    def release(self, request_id: str) -> None:
        """The request finished: what its drafts accepted over its whole life (rounds and
        shadow drafts, not the decayed estimate) moves the prior of the next ones of its
        kind, clamped to [0.05, 0.95] so one request's extreme luck neither rules
        speculation out nor in for good. A request with little evidence moves it less: full
        weight from `learned_full_trials` trials (one lucky probe is not the pair's rate)."""
        est = self._est.pop(request_id, None)
        if est is not None and est.seen_trials > 0 and self.learned_weight > 0:
            a = min(0.95, max(0.05, est.seen_accepted / est.seen_trials))
            weight = self.learned_weight * min(1.0, est.seen_trials / self.learned_full_trials)
            old = self.prior(est.sampled)
            self._learned[est.sampled] = old + weight * (a - old)
