"""Shadow drafts: acceptance evidence for free while a request decodes plainly.

A request the adaptive policy keeps at K = 0 only learns that speculation would pay again
through probes, real speculative rounds that cost verification and are spaced out to stay
within a budget. On text whose repetitiveness comes and goes (a code edit: long copies
broken by new lines) a probe comes too late. A proposer whose drafts are deterministic
and nearly free (n-gram tables: a lookup, c = 0) allows something better: ask it for a
draft every few plain steps, verify nothing, and compare the draft with the tokens plain
decoding then produces.

Such a comparison is an unbiased sample of what verification would have accepted. For a
one-hot draft token t, `rejection.verify` accepts t with probability p(t), the target's
probability of t after the request's sampling transforms, and plain decoding emits t with
the same probability p(t). Greedy decoding accepts t exactly when it emits t. Later
positions follow by conditioning on the earlier ones. So "the first j tokens matched"
has the same distribution as "j tokens accepted". The policy takes it as a round of j
accepted out of k drafted.

Only scheduling reads the result; the output is plain decoding's, bit for bit.

A request that asked for a real draft and got none (an n-gram miss: nothing in the table
continues its text) is *watched* (`watch`): looked up (for drafts of two tokens, all the
rule below reads) under every plain step's forward until a lookup finds a draft of two
tokens or more whose first token the step then emits, which is reported to `found` (the
proposer will then have the rest of that draft when the policy asks at the next step; a
one-token draft's chain ended there, so the real lookup would miss), for at most
`max_interval` steps (the policy asks again by then). For that the
first token is checked right after the step (`check`, or `check_found` in a plain stretch,
whose other checks run under the next step's forward: a step later the token after it
would have to continue the chain too, which at T > 0 it mostly does not). A watch's
lookups are no evidence, and the request's scheduled shadows pause while it is watched:
its estimate waits, as the policy does after a miss (taken at every step while the text
has no match, failing drafts would flood the estimate; on the replayed code edit, W5 at
T=0, the request then stopped speculating just before its text repeated). So a request
waiting for its text to repeat costs no policy step per lookup, and is asked again as soon
as a draft would exist, not on a backoff schedule.

Cost: one proposer call per shadow (its table catch-up would happen at the next real round
anyway) plus a list comparison as tokens arrive. A request's first shadow comes at its
first plain step (the policy lets a request speculate only once it has evidence; the
runner tells `admit` when a request joins), the next ones every `interval` steps. The
interval doubles up to `max_interval` while shadows match fewer than two tokens (one token
is what a sampled request matches by chance) and returns to `interval` after one matches
more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.engine.request import Request
    from infer.spec.proposer import Proposer

# (request_id, drafted, matched): the policy's update for a round of `drafted` tokens
Observe = Callable[[str, int, int], None]
# (request_id): a watched request's draft was continued by the next token (see `watch`)
Found = Callable[[str], None]


def matched_prefix(draft: Sequence[int], actual: Sequence[int]) -> tuple[int, bool]:
    """(tokens of `draft` matched by `actual` before the first difference, resolved).

    Resolved: a difference was seen, or `actual` covers the whole draft; otherwise more
    tokens are needed to tell."""
    for j, (d, a) in enumerate(zip(draft, actual)):
        if d != a:
            return j, True
    n = min(len(draft), len(actual))
    return n, n == len(draft)


@dataclass(slots=True)
class _Pending:
    start: int  # the request's token count when the draft was taken (the draft continues it)
    tokens: list[int]
    watch: bool = False  # a watched request's lookup: it only tells `found`, it is no evidence


@dataclass(slots=True)
class _Schedule:
    due: int  # step at which the next shadow may be taken
    interval: int


@dataclass
class ShadowDrafts:
    """Takes and checks shadow drafts for requests decoding plainly (see the module docstring)."""

    k: int  # tokens per shadow draft (the speculation length)
    observe: Observe
    interval: int = 8
    max_interval: int = 64
    found: Found | None = None
    _step: int = 0
    _next_due: int = 0  # the earliest `due` over scheduled requests (skips the scan before it)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _schedule: dict[str, _Schedule] = field(default_factory=dict)
    _watched: dict[str, int] = field(default_factory=dict)  # id -> last step it is looked up at every step

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"shadow drafts need k >= 1, got {self.k}")
        if not 1 <= self.interval <= self.max_interval:
            raise ValueError(f"need 1 <= interval <= max_interval, got {self.interval} and {self.max_interval}")

    @property
    def _found_length(self) -> int:
        """The draft length a watched request's lookup needs for `found` once its first token
        came true: 2 (the next real lookup then finds the rest of the chain), or 1 when k is
        1 (all there is to go by)."""
        return min(2, self.k)

    def __len__(self) -> int:
        return len(self._pending)

    def admit(self, request_id: str) -> None:
        """A request joined the batch: the next `take` looks at it (its first shadow is due at
        once, whatever the others' schedules)."""
        self._next_due = 0

    def watch(self, request_id: str) -> None:
        """The request asked for a draft and the proposer had none: look it up at every step
        from the next on, and report `found` when a draft's first token comes true (for at
        most `max_interval` steps)."""
        self._watched[request_id] = self._step + self.max_interval
        self._next_due = min(self._next_due, self._step + 1)

    def take(self, proposer: Proposer, requests: Sequence[Request], ks: Sequence[int] | None = None) -> None:
        """Before a decode step: draft in shadow for the requests given k = 0 (ks None: all
        of them) whose turn it is."""
        self._step += 1
        if self._step < self._next_due:
            return
        chosen, watching = [], []
        # the proposer's optional `ready(request)`: whether it can look a request up without
        # building its state on the critical path (n-gram: False while its table is unbuilt,
        # part-built or far behind); such requests wait. And `admits(request)`: whether it
        # keeps state for the request at all (n-gram: a table worth its cost); one it turns
        # down is asked again after the interval, not at every step
        ready, waiting = getattr(proposer, "ready", None), False
        admits = getattr(proposer, "admits", None)
        for r, k in zip(requests, ks if ks is not None else [0] * len(requests), strict=True):
            rid = r.request_id
            if k or rid in self._pending:
                continue
            s = self._schedule.get(rid)
            if (admits is not None and (s is None or self._step >= s.due or rid in self._watched)
                    and not admits(r)):  # (nothing to look up in: no watch either)
                self._watched.pop(rid, None)
                if s is None:
                    s = self._schedule[rid] = _Schedule(self._step, self.interval)
                s.due = self._step + s.interval
                continue
            if ready is not None and not ready(r):  # (its table is being built: asked again next step)
                waiting = True
                continue
            if s is None:  # first sight: draft now (the policy waits for this evidence)
                s = self._schedule[rid] = _Schedule(self._step, self.interval)
            if rid in self._watched:  # (no scheduled shadows meanwhile: the estimate waits as the policy does)
                if self._step <= self._watched[rid]:
                    chosen.append(r)
                    watching.append(True)
                    continue
                del self._watched[rid]  # the watch ran out (the policy asks again by then)
            if self._step >= s.due:
                chosen.append(r)
                watching.append(False)
        if chosen:
            # a watch's lookup needs only the draft's first `_found_length` tokens (`_found`):
            # shorter chains cost less, and resolve (free the request for its next lookup) sooner
            drafts = proposer.propose(chosen, [self._found_length if w else self.k for w in watching])
            for r, d, watch in zip(chosen, drafts, watching, strict=True):
                if d.token_ids:
                    self._pending[r.request_id] = _Pending(r.num_tokens, list(d.token_ids), watch)
                elif not watch:  # nothing to compare: try again after the interval
                    self._schedule[r.request_id].due = self._step + self._schedule[r.request_id].interval
        self._next_due = min((self._step + 1 if rid in self._watched else s.due
                              for rid, s in self._schedule.items() if rid not in self._pending),
                             default=self._step + self.interval)
        if waiting:
            self._next_due = self._step + 1

    def check_found(self, requests: Sequence[Request]) -> int:
        """Right after a step: report `found` for watched requests whose pending lookup's first
        token the step emitted (see `check`); the rest of `check` may wait. Returns how many."""
        if not self._watched or not self._pending:
            return 0
        found = 0
        for r in requests:
            p = self._pending.get(r.request_id)
            if p is not None and self._found(r, p):
                found += 1
        return found

    def _found(self, r: Request, p: _Pending) -> bool:
        """Report `found` if `r` is watched, its pending draft `p` is long enough and its first
        token is the request's token there (the watch ends)."""
        if (r.request_id in self._watched and len(p.tokens) >= self._found_length and r.num_tokens > p.start
                and r.token_slice(p.start, p.start + 1)[0] == p.tokens[0]):
            del self._watched[r.request_id]
            if self.found is not None:
                self.found(r.request_id)
                return True
        return False

    def check(self, requests: Sequence[Request]) -> int:
        """After a decode step: compare pending drafts with the tokens the requests now hold.
        Returns how many reports were made: drafts resolved (to `observe`; a watch's lookups
        are not evidence: taken at every step while the text has no match, they would flood
        the estimate) and watched requests found (to `found`)."""
        if not self._pending:
            return 0
        reports = 0
        for r in requests:
            p = self._pending.get(r.request_id)
            if p is None:
                continue
            matched, resolved = matched_prefix(p.tokens, r.token_slice(p.start, p.start + len(p.tokens)))
            if matched and self._found(r, p):
                reports += 1
            if not resolved:
                continue
            del self._pending[r.request_id]
            if p.watch:  # a watch's lookup: the request's schedule and estimate are not its business
                self._next_due = min(self._next_due, self._step + 1)
                continue
            s = self._schedule[r.request_id]
            s.interval = self.interval if matched >= 2 else min(2 * s.interval, self.max_interval)
            s.due = self._step + s.interval
            self._next_due = min(self._next_due, self._step + 1 if r.request_id in self._watched else s.due)
            self.observe(r.request_id, len(p.tokens), matched)
            reports += 1
        return reports

    def leak_report(self) -> list[str]:
        """What is still held: pending drafts and schedules (of requests that never left)."""
        return ([f"shadow drafts pending for {sorted(self._pending)}"] if self._pending else []) + (
            [f"shadow schedules kept for {sorted(self._schedule)}"] if self._schedule else []) + (
            [f"shadow watches kept for {sorted(self._watched)}"] if self._watched else [])

    def release(self, request_id: str) -> None:
        """The request left the batch: forget its pending draft, schedule and watch."""
        self._pending.pop(request_id, None)
        self._schedule.pop(request_id, None)
        self._watched.pop(request_id, None)
