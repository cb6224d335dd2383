"""N-gram speculative drafting: draft tokens from the request's own history, no draft model.

Two table kinds, both built only from tokens the request really has (prompt + accepted output),
both pure Python, per request:

* `NgramTable` — frequency tables in the manner of akunu's NGramPredictor (the "Speculative
  Decoding with N-grams" chapter). An n-gram of *order* n is n - 1 context tokens followed by
  one next token; orders run from `min_order` to `max_order` (default 2..4, i.e. contexts of
  1..3 tokens: bigrams, trigrams, 4-grams). For each order the table maps a context (a tuple of
  token ids; Python hashes tuples exactly, so unlike the chapter's FNV-1a key there are no
  collisions) to next-token counts. `predict` tries the longest context first, falls back to
  shorter ones, and picks the most frequent continuation (ties: the most recently seen wins).
  `propose` chains predictions on a temporary context and stops at the first miss.
* `PromptLookupTable` — prompt lookup decoding: find the longest suffix of the context
  (max_order - 1 tokens down to min_order - 1 tokens, the same "order" meaning as above) that
  occurred earlier in the history, and copy the tokens that followed its most recent earlier
  occurrence.

Sliding window: both tables hold exactly the n-grams that lie wholly inside the last `window`
tokens; when a token leaves the window, the n-grams starting at it are decremented/removed.
(The chapter's akunu keeps counts forever and only windows the history; this module windows the
counts too, so memory stays bounded and `rebuild == incremental` holds exactly.)

Rollback rule: proposing never touches a table; tables are extended only with tokens the request
holds after verification, so rejected drafts never enter them. `NgramProposer` keeps one table
per request and syncs it with `request.all_token_ids` before proposing.

Tables cost host time: a few us a token (three dict levels per token, Python) to build from
the prompt and to follow the output. `NgramProposer.admit`, when set (the adaptive runner:
`AdaptivePolicy.table_pays`), decides for each request without a table whether one is worth
starting; a request it turns down gets no table, so no lookup (its drafts are empty) and no
shadow drafts, and is asked again later (its batch shrinks, the rates change). The cost a
token is measured on the tables' own builds (`seconds_per_token`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING

from infer.spec.ngram_tables import METHODS, DraftTable, NgramConfig, NgramTable, PromptLookupTable, is_strict_int
from infer.spec.proposer import Draft

__all__ = ["METHODS", "NgramConfig", "NgramProposer", "NgramTable", "PromptLookupTable", "DraftTable"]

if TYPE_CHECKING:
    from infer.engine.request import Request

_TABLES: dict[str, type[NgramTable] | type[PromptLookupTable]] = {
    "ngram": NgramTable,
    "prompt_lookup": PromptLookupTable,
}


def _tokens_from(request: Request, lo: int, hi: int) -> list[int]:
    """request.all_token_ids[lo:hi] without concatenating the whole history."""
    return request.token_slice(lo, hi)


_TAIL = 16  # tokens compared to tell that a request's history was replaced
# tokens a table build adds between two asks whether the GPU is still busy (`keep_up` with
# `busy`): ~0.2 ms of Python on the H200's host, the most a build runs past the GPU's work
BUILD_CHUNK = 64
# host seconds a table costs per token it indexes, until builds measure it (GPU hosts,
# NgramTable, three levels: ~3-4.5 us; the dev CPU ~1-1.5 us); builds of at least
# _TIMED_BUILD tokens move the estimate by _COST_WEIGHT
DEFAULT_SECONDS_PER_TOKEN = 3e-6
_TIMED_BUILD = 16
_COST_WEIGHT = 0.25


@dataclass(slots=True)
class _Entry:
    table: DraftTable
    synced: int  # number of the request's tokens the table has seen
    tail: list[int]  # the last (up to) _TAIL of those tokens


class NgramProposer:
    """Proposer over per-request n-gram (or prompt lookup) tables; drafts have probs=None."""

    shadow_drafts = True  # a lookup, deterministic: checkable against plain decoding for free

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config if config is not None else NgramConfig()
        self._entries: dict[str, _Entry] = {}
        # requests whose table `keep_up` left unbuilt or part-built when the GPU ran out of
        # work (`ready` is False for them until a later `keep_up` or `propose` finishes it)
        self._building: set[str] = set()
        # wall time the last propose() spent bringing existing tables up to date after plain
        # steps (more tokens than one round emits): the adaptive policy's cost of switching
        # back. A request's first table build is a one-off, like a prefill, and not counted.
        self.catch_up_seconds = 0.0
        self.catch_up_chunks = 0  # requests that catch-up brought up to date
        # wall time the last propose() spent on such one-offs (a request alone: its first
        # build, or finishing one `keep_up` left part-built), which the runner times nowhere:
        # not the round's cost, not the switch's, not its speculative episode's (H100, W5 at
        # T=0: a 640-token prompt's table finished in a generation's first round made the
        # episode look lost, kappa fell to 0.4 and the 1.6x speedup went, run 24c)
        self.setup_seconds = 0.0
        # whether a request without a table should get one (None: every request does); see
        # the module docstring
        self.admit: Callable[[Request], bool] | None = None
        # host seconds per token a table build costs (moving estimate over timed builds)
        self.seconds_per_token = DEFAULT_SECONDS_PER_TOKEN

    def __len__(self) -> int:
        return len(self._entries)

    def table(self, request_id: str) -> DraftTable | None:
        """The request's current table, or None if it has none (for inspection and tests)."""
        entry = self._entries.get(request_id)
        return entry.table if entry is not None else None

    def _new_table(self) -> DraftTable:
        cfg = self.config
        return _TABLES[cfg.method](cfg.max_order, cfg.min_order, cfg.window)

    def _sync(self, request: Request, limit: int | None = None) -> DraftTable:
        """Bring the request's table up to date: incremental, or rebuilt if history changed;
        with `limit`, by at most that many tokens (a part-built table goes on from there).

        A request's tokens only grow, so comparing the last few tokens the table saw tells a
        replaced history (a restarted request) cheaply; this runs on every proposal. After a
        gap longer than the window, a rebuild from the window is cheaper and gives the same
        table."""
        n = request.num_tokens
        entry = self._entries.get(request.request_id)
        if (entry is None or not entry.synced <= n < entry.synced + self.config.window
                or _tokens_from(request, entry.synced - len(entry.tail), entry.synced) != entry.tail):
            # first sight, a long gap, or a restart with another history: from the window's start
            start = max(0, n - self.config.window)
            entry = self._entries[request.request_id] = _Entry(self._new_table(), start, [])
        if n > entry.synced:
            end = n if limit is None else min(n, entry.synced + limit)
            entry.table.extend(_tokens_from(request, entry.synced, end))
            entry.synced = end
            entry.tail = _tokens_from(request, max(0, end - _TAIL), end)
        if entry.synced == n:
            self._building.discard(request.request_id)
        return entry.table

    def _build(self, request: Request, limit: int | None = None) -> None:
        """`_sync` for a build (`keep_up`), timed: builds of at least _TIMED_BUILD tokens move
        `seconds_per_token`."""
        old = self._entries.get(request.request_id)
        before = old.synced if old is not None else 0
        start = perf_counter()
        self._sync(request, limit)
        seconds = perf_counter() - start
        entry = self._entries[request.request_id]
        added = entry.synced - before if entry is old else len(entry.table.history)
        if added >= _TIMED_BUILD:
            self.seconds_per_token += _COST_WEIGHT * (seconds / added - self.seconds_per_token)

    def admits(self, request: Request) -> bool:
        """Whether the request has a table or may start one (`admit`); a request turned down
        gets no lookups (empty drafts) and no builds until a later call admits it."""
        admit = self.admit
        return admit is None or request.request_id in self._entries or admit(request)

    def ready(self, request: Request) -> bool:
        """Whether a lookup now needs no build: False while the request's table is unbuilt,
        part-built or far behind (a lookup would build it on the critical path: shadow
        drafts wait for it). Such a table is then queued for `keep_up`'s builds under the
        next forwards (`building`): it may have missed them, its prefill's builds skipped
        while shadowing did not pay at the batch's size (H200, n-gram at W2-prefix T=1:
        shadow lookups that built 16 tables took 6.7 ms, against a 1.5 ms step). False,
        and nothing queued, for a request `admits` turns down."""
        if not self._needs_build(request):
            return True
        if not self.admits(request):
            return False
        self._building.add(request.request_id)
        return False

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ks[i] tokens continuing requests[i].all_token_ids (possibly none). Alone, a
        request's table is built or caught up here if need be; in a batch, a table that needs
        a build (`ready` False) is queued for `keep_up` and its request drafts nothing."""
        if len(ks) != len(requests):
            raise ValueError(
                f"ks must give one draft length per request: got {len(ks)} for {len(requests)} requests"
            )
        drafts: list[Draft] = []
        self.catch_up_seconds = self.setup_seconds = 0.0
        self.catch_up_chunks = 0
        batched = len(requests) > 1
        for request, k in zip(requests, ks):
            if not is_strict_int(k) or k < 0:
                raise ValueError(f"ks must hold integers >= 0, got {k!r} for request {request.request_id!r}")
            if not k:  # (its table catches up when it drafts, or under a forward: `keep_up`)
                drafts.append(Draft(token_ids=[], probs=None))
                continue
            n = request.num_tokens
            entry = self._entries.get(request.request_id)
            if entry is None and not self.admits(request):  # no table worth its cost: no draft
                drafts.append(Draft(token_ids=[], probs=None))
                continue
            if batched and not self.ready(request):
                # in a batch, a table still to build (none yet, part-built, far behind) is
                # queued for `keep_up` under the next forwards, not built here on the whole
                # batch's critical path: no draft this round (H100, W2 at T=1: a round at
                # batch 32 that built its requests' tables took 29 ms, 17 plain steps, run 23g)
                drafts.append(Draft(token_ids=[], probs=None))
                continue
            behind = 0 if entry is None else n - entry.synced
            first = entry is None or request.request_id in self._building  # (a build: the table's prefill)
            start = perf_counter()
            table = self._sync(request)
            if first:
                self.setup_seconds += perf_counter() - start
            elif behind > k + 1:
                self.catch_up_seconds += perf_counter() - start
                self.catch_up_chunks += 1
            context = _tokens_from(request, max(0, n - self.config.max_order + 1), n)
            drafts.append(Draft(token_ids=table.propose(context, k), probs=None))
        return drafts

    def keep_up(self, requests: Sequence[Request], busy: Callable[[], bool] | None = None) -> None:
        """Build or bring up to date the requests' tables (the runner calls this while a
        prefill's or a plain step's forward runs), so that a later `propose` has only its
        lookups left to do before its step's forward.

        With `busy` (whether the GPU still runs the step's work), only builds run (tables
        missing, part-built or more than BUILD_CHUNK tokens behind), BUILD_CHUNK tokens at a
        time while it says so (one chunk a call at least); what is left when it stops is
        marked (`ready` False) and goes on at the next call. A
        batch's new tables (W2: 32 prompts, ~8,700 tokens, ~25 ms of Python on the H200's
        host against a ~10 ms prefill forward) then spread over the forwards that follow,
        under the GPU's work, rather than holding up the step."""
        if busy is None:
            for request in requests:
                if not self.admits(request):
                    self._building.discard(request.request_id)
                elif self._needs_build(request):
                    self._build(request)
                else:
                    self._sync(request)
            return
        built = False  # one chunk a call at least: a forward shorter than the host's way to
        # this call (batch 1 on the H200: W5 at T=0 fell from 1.74x to 1.06x) must not starve the builds
        for i, request in enumerate(requests):
            if not self._needs_build(request):  # a few tokens behind at most: left to its next
                continue  # lookup or whole `keep_up` (a sync is ~3 us even for one token: the
                # batch's syncs added ~170 us to each step of a build at batch 32, dev CPU)
            if not self.admits(request):  # no table worth its cost (queued while it was)
                self._building.discard(request.request_id)
                continue
            while not self._up_to_date(request):
                if built and not busy():
                    self._building.update(r.request_id for r in requests[i:]
                                          if self._needs_build(r) and self.admits(r))
                    return
                self._build(request, BUILD_CHUNK)
                built = True

    def _needs_build(self, request: Request) -> bool:
        """Whether bringing the request's table up to date is a build (no table, one left
        part-built, or more than BUILD_CHUNK tokens behind), not a few tokens' update."""
        entry = self._entries.get(request.request_id)
        return (entry is None or request.request_id in self._building
                or request.num_tokens - entry.synced > BUILD_CHUNK)

    def _up_to_date(self, request: Request) -> bool:
        entry = self._entries.get(request.request_id)
        return entry is not None and entry.synced == request.num_tokens

    @property
    def building(self) -> bool:
        """Whether some table waits for `keep_up` to finish it."""
        return bool(self._building)

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """Nothing: a table takes the verified tokens at its next lookup or `keep_up`. (The
        runner calls this for every request of a round, between the round and the next
        step, before it emits the round's tokens: a sync here found nothing new for the
        requests that drafted, and for those given k = 0 it caught their tables up on the
        critical path.)"""

    def release(self, request: Request) -> None:
        """The request finished or was preempted: drop its table (a later propose rebuilds)."""
        self._entries.pop(request.request_id, None)
        self._building.discard(request.request_id)

    def leak_report(self) -> list[str]:
        """Tables still held (of requests that never left)."""
        return ([f"n-gram tables kept for {sorted(self._entries)}"] if self._entries else []) + (
            [f"n-gram tables being built for {sorted(self._building)}"] if self._building else [])
