"""Shadow rounds: what a free draft would have scored while its request decodes plainly.

Where acceptance comes in bursts, a request the adaptive policy leaves plain would miss a
stretch that pays until its next probe. A free draft (n-gram tables, prompt lookup) can be
scored without a round: at a plain step `ShadowRounds.draft` keeps the chain the proposer
would propose now, and `settle` reports (drafted, accepted) once the request's tokens decide
it, evidence for `AdaptivePolicy.observe`. At most one chain per request is pending. Chains
are drafted from the request's known tokens only (`known_tokens`: under overlap the newest
token is still in flight). docs/speculation.md, "Shadow rounds".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.speculative.proposer import DraftRequest, Proposer
from infer.speculative.tree import chain_shape


@dataclass(frozen=True, slots=True)
class _Pending:
    start: int  # the request's token count when the chain was drafted: chain[i] guesses token start + i
    chain: tuple[int, ...]


def score(chain: Sequence[int], produced: Sequence[int]) -> int | None:
    """Accepted tokens of `chain` against the tokens `produced` after it was drafted: the
    common prefix, once decided (a mismatch, or every drafted token present); None while
    every produced token matches and more are needed."""
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
        self.num_tokens = request.num_tokens - request.pending_tokens
        self.pending_tokens = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._request, name)


def known_tokens(request: DraftRequest) -> DraftRequest:
    """`request` itself when every token is known, else a view of its known tokens."""
    return request if not request.pending_tokens else _Known(request)  # type: ignore[return-value]


class ShadowRounds:
    """Pending shadow chains per request (module docstring)."""

    def __init__(self, proposer: Proposer, k: int) -> None:
        if k < 1:
            raise ValueError(f"shadow rounds draft k >= 1 tokens, got {k}")
        self.proposer, self.k = proposer, k
        self._pending: dict[str, _Pending] = {}

    def settle(self, requests: Sequence[DraftRequest]) -> list[tuple[str, int, int]]:
        """(request_id, drafted, accepted) of every pending chain of these requests that
        their tokens now decide; those chains are dropped."""
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
        """Keep the chain the proposer would draft now, from the known tokens, for each
        request without one pending (a chain drafted under a token in flight guesses it first)."""
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
