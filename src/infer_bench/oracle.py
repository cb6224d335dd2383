"""OracleProposer: drafts whose acceptance the benchmark controls. Used only by the benchmark.

The oracle wraps the run's real proposer: every round runs the inner `propose` at its full
cost, then replaces the tokens node by node, breadth-first: a node whose parent path holds
the target's greedy continuation (recorded by a plain run) gets its token with probability
alpha, else a wrong one. Requests are greedy and drafts deterministic, so the verifier
accepts exactly those nodes. A round that follows the round in flight (an EAGLE head's
`can_follow`) is replaced on the device: the coins are drawn on the host, the record's
tokens gathered at the row's start the device knows. docs/benchmarks.md, "Controlled
acceptance".
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.speculative.eagle import EagleProposer
from infer.speculative.proposer import DraftRequest, Proposer
from infer.speculative.tree import Draft, RoundTokens, TreeShape
from infer.transfer import to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


@dataclass
class OracleCounts:
    """What the oracle saw since its alpha was last set."""

    rounds: int = 0  # verified rounds with at least one proposed node
    tried: int = 0  # nodes tried by the trial model (module docstring)
    accepted: int = 0  # of those, the verifier accepted
    off_record_rounds: int = 0  # rounds of requests that left every recorded continuation
    host_s: float = 0.0  # host time the oracle added (token replacement and counting)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.tried if self.tried else None

    def to_dict(self) -> dict[str, float | int | None]:
        return {"oracle_rounds": self.rounds, "oracle_tried": self.tried, "oracle_accepted": self.accepted,
                "oracle_acceptance": self.acceptance, "oracle_off_record_rounds": self.off_record_rounds,
                "oracle_host_ms_per_round": self.host_s * 1e3 / self.rounds if self.rounds else None}


@dataclass
class _Follow:
    record: list[int] | None  # the continuation this request follows; None: off every record
    checked: int  # its first `checked` tokens were compared with the record
    index: int = -1  # the record's, among the oracle's


class OracleProposer:
    """Bench only: the inner proposer's drafts with tokens chosen for acceptance alpha (module docstring)."""

    def __init__(self, inner: Proposer, records: Sequence[Sequence[int]], vocab_size: int, alpha: float,
                 seed: int | str = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"the oracle needs a vocabulary of at least 2 tokens for wrong drafts, got {vocab_size}")
        if not records or any(len(r) < 2 for r in records):
            raise ValueError("the oracle needs one recorded continuation (prompt + greedy output, at least 2 "
                             "tokens) per prompt: run the prompts through a plain engine first")
        self.inner = inner
        self.vocab_size = vocab_size
        self._records = [list(r) for r in records]
        self._follow: dict[str, _Follow] = {}
        # each request's drafts not yet verified, oldest first (a round in flight and the next)
        self._proposed: dict[str, list[Draft]] = {}
        self._on_device: dict[torch.device, torch.Tensor] = {}  # the records [R, L] (-1 past an end)
        self.set_alpha(alpha, seed)

    def set_alpha(self, alpha: float, seed: int | str = 0) -> None:
        """A new alpha with a fresh random stream; the counts start again."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha is a probability in [0, 1], got {alpha!r}")
        self.alpha = alpha
        self._rng = random.Random(seed)
        self.counts = OracleCounts()

    # -- proposing ---------------------------------------------------------------------------
    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        """The inner proposer's, for requests on a record (replaced on the device: `_follow_round`)."""
        return all((f := self._follow.get(r.request_id)) is not None and f.record is not None for r in requests) \
            and self.inner.can_follow(requests, k)

    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        follow = shape.is_chain and bool(depths) and len(set(depths)) == 1 and self.can_follow(requests, depths[0])
        drafts = self.inner.propose(requests, shape, depths)
        start = time.perf_counter()
        if follow:
            out = self._follow_round(requests, drafts, depths[0])
            self.counts.host_s += time.perf_counter() - start
            return out
        out = []
        for r, draft in zip(requests, drafts, strict=True):
            if not draft.num_proposed:
                out.append(draft)
                continue
            if not r.sampling_params.greedy:
                raise ValueError(f"request {r.request_id}: the oracle's acceptance is exact at temperature 0 only "
                                 "(greedy verification); run the acceptance sweep with temperature 0")
            record = self._record(r)
            new = draft if record is None else self._replace(draft, record, r.num_computed_tokens)
            if record is None:
                self.counts.off_record_rounds += 1
            self._proposed.setdefault(r.request_id, []).append(new)
            out.append(new)
        self.counts.host_s += time.perf_counter() - start
        return out

    def _record(self, r: DraftRequest) -> list[int] | None:
        """The continuation request r follows, checked up to its pending token (None: off record)."""
        known = r.num_computed_tokens + 1  # tokens[n] is the pending token g
        follow = self._follow.get(r.request_id)
        if follow is None:
            tokens = r.token_slice(0, known)
            index = next((i for i, rec in enumerate(self._records) if rec[:known] == tokens), -1)
            follow = self._follow[r.request_id] = _Follow(self._records[index] if index >= 0 else None, known, index)
        elif follow.record is not None and known > follow.checked:
            if follow.record[follow.checked:known] != r.token_slice(follow.checked, known):
                follow.record = None
            follow.checked = known
        return follow.record

    def _follow_round(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], k: int) -> list[Draft]:
        """The inner round's chains of k on the device, replaced there (module docstring): a
        row's first L nodes the record's tokens from its start, node L a wrong one (L: the
        coins' first miss), the rest as drafted; past the record's end, as drafted."""
        inner = self.inner
        assert isinstance(inner, EagleProposer)
        head = [inner.states[r.request_id].follows for r in requests]
        counts, _, _ = head[0]  # type: ignore[misc]
        tokens = drafts[0].on_device[0].tokens[:len(requests), :k]  # type: ignore[index]
        device = tokens.device
        records = self._on_device.get(device)
        if records is None:
            width = max(len(r) for r in self._records)
            records = self._on_device[device] = torch.tensor(
                [rec + [-1] * (width - len(rec)) for rec in self._records], dtype=torch.long, device=device)
        misses = []
        for _ in requests:  # (the coins of a chain: right until the first miss)
            n = 0
            while n < k and self._rng.random() < self.alpha:
                n += 1
            misses.append(n)
        index = [self._follow[r.request_id].index for r in requests]
        host = torch.tensor([index, [r.num_computed_tokens - k for r in requests], misses], dtype=torch.long)
        rec, base, miss = to_device(host, device)
        depth = torch.arange(k, device=device)
        at = (base + counts[:len(requests)])[:, None] + 1 + depth[None, :]  # [B, k]: the nodes' truths (g at n)
        truth = records[rec[:, None], at.clamp(max=records.shape[1] - 1)]  # [B, k] (-1: past the record)
        chosen = torch.where(depth[None, :] < miss[:, None], truth, (truth + 1) % self.vocab_size)
        out = RoundTokens(torch.where((depth[None, :] <= miss[:, None]) & (truth >= 0), chosen, tokens))
        replaced = []
        for b, (r, d) in enumerate(zip(requests, drafts, strict=True)):
            new = Draft.chain_on_device(d.shape, out, b, k)
            self._proposed.setdefault(r.request_id, []).append(new)
            replaced.append(new)
        return replaced

    def _replace(self, draft: Draft, record: list[int], n: int) -> Draft:
        """The draft's present nodes with the oracle's tokens; g is token n of the record."""
        shape = draft.shape
        # (tokens left on the device stay unread: nodes the oracle leaves alone draft token 0)
        tokens = list(draft.host_ids) if draft.host_ids is not None else [0] * shape.num_nodes
        right = [False] * shape.num_nodes  # the node and its ancestors hold the continuation
        taken: set[int] = set()  # parents (-1: the root) one of whose children holds it
        for node, (present, parent, depth) in enumerate(zip(draft.valid, shape.parents, shape.depths, strict=True)):
            if not present or (parent >= 0 and not right[parent]) or n + depth >= len(record):
                continue  # never reached by the verifier, or past the record: the inner token stays
            truth = record[n + depth]
            if parent not in taken and self._rng.random() < self.alpha:
                tokens[node], right[node] = truth, True
                taken.add(parent)
            else:
                sibling = shape.children[parent].index(node) if parent >= 0 else node
                tokens[node] = (truth + 1 + sibling % (self.vocab_size - 1)) % self.vocab_size
        return Draft(shape, tuple(tokens), draft.valid, None)

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        start = time.perf_counter()
        for r, path in zip(requests, paths, strict=True):
            waiting = self._proposed.get(r.request_id)
            draft = waiting.pop(0) if waiting else None
            if waiting == []:
                del self._proposed[r.request_id]
            if draft is not None:
                tried, accepted = trials(draft, path)
                self.counts.rounds += 1
                self.counts.tried += tried
                self.counts.accepted += accepted
        self.counts.host_s += time.perf_counter() - start
        self.inner.on_accepted(requests, paths)

    # -- the rest is the inner proposer's --------------------------------------------------------
    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        self.inner.verifying(requests, drafts, starts, verdict)

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        self.inner.observed(requests, starts, rows)

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        self.inner.prefilled(requests)

    def release(self, request: DraftRequest) -> None:
        self._follow.pop(request.request_id, None)
        self._proposed.pop(request.request_id, None)
        self.inner.release(request)

    def can_admit(self, request: DraftRequest) -> bool:
        return self.inner.can_admit(request)

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        return self.inner.ensure_capacity(request, total_tokens, take)

    def pools(self) -> list[CachePoolProtocol]:
        return self.inner.pools()

    def leak_report(self) -> list[str]:
        held = sorted(set(self._follow) | set(self._proposed))
        return ([f"oracle still follows requests {held}"] if held else []) + self.inner.leak_report()


def trials(draft: Draft, path: Sequence[int]) -> tuple[int, int]:
    """(nodes tried, nodes accepted) of one verified draft under the trial model: down the
    accepted path, the siblings before each accepted node and the node itself; where the
    path stops, every present child of its last node."""
    shape = draft.shape
    tried = 0
    kids = shape.root_children
    for depth in range(shape.depth + 1):
        present = [k for k in kids if draft.valid[k]]
        if not present:
            break
        if depth == len(path):
            tried += len(present)
            break
        tried += present.index(path[depth]) + 1
        kids = shape.children[path[depth]]
    return tried, min(len(path), shape.depth)
