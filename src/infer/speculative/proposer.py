"""Proposer protocol: where draft tokens come from. `Proposer` declares every hook the runner
calls (a new proposer implements it and nothing else); `DraftRequest` is what a proposer may read
of a request, so this layer never imports the engine; `HostProposer` serves host-memory proposers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from infer.sampling import SamplingParams
from infer.speculative.faults import isolated

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.speculative.grammar_mask import GrammarState
    from infer.speculative.tree import Draft, TreeShape


class DraftRequest(Protocol):
    """The view of a running request that proposers read."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    slot: int | None
    num_computed_tokens: int  # tokens whose KV is in the target's cache; tokens[n] is pending
    pending_tokens: int  # the newest tokens, still in flight: counted in num_tokens, not yet known
    generator: torch.Generator
    grammar: GrammarState | None  # a structured output's grammar state (None: free text)
    fault: str | None  # why the request failed this step (`speculative.faults`; None: it has not)

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def prefill_target(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...  # (at `Proposer.release`: finished, or preempted)

    def token_slice(self, lo: int, hi: int | None = None) -> list[int]: ...


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        """One draft over `shape` per request, no node deeper than depths[i] (0: an empty draft; a
        chain: its first depths[i] nodes or fewer). A model's cache holds node j at n + 1 + j (g at n)."""
        ...

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """After verification, before the tokens are emitted: paths[i], the accepted node indices of
        requests[i] in depth order (a chain: 0 .. a-1); roll the proposer's state back to them. For a
        round whose next round already runs (`can_follow`) `observed` does not follow."""
        ...

    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """A round of chains is being verified on the device: verdict [B, K + 2] long (accepted drafts,
        their count at column K, the final token), starts[i] the forward token where requests[i]'s
        block begins. A proposer may queue its next round's drafts now; `on_accepted` follows."""
        ...

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        """Whether the requests' next round, a chain of k each, is drafted already on the device, so it
        may be queued before the host reads the round in flight (docs/speculation.md, "Rounds in flight")."""
        ...

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """A prefill forward for these requests was just queued: host work for their first proposals can run now."""
        ...

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """The target's forward committed, for requests[i], the forward's tokens rows[i] (flat batch
        indices) at positions starts[i], starts[i] + 1, ...; a proposer reading hidden states reads them now."""
        ...

    def release(self, request: DraftRequest) -> None:
        """The request finished or was preempted: drop its state and memory."""
        ...

    def can_admit(self, request: DraftRequest) -> bool:
        """Whether the proposer's own memory could hold the request's prompt."""
        ...

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        """Room for positions < total_tokens of the request (taken now with `take`, else at its first
        round); False, nothing taken, when memory is short: the scheduler preempts."""
        ...

    def pools(self) -> list[CachePoolProtocol]:
        """KV pools the proposer owns (a draft model's), for capacity checks and reports."""
        ...

    def leak_report(self) -> list[str]:
        """State still held (when no request should be running)."""
        ...


class HostProposer:
    """The hooks of a proposer whose state is host memory built from verified tokens alone (n-gram
    tables, suffix tries), brought up to date by `sync`: nothing to roll back, no device memory."""

    building = "building its draft state"  # what `prefilled` was doing, for a fault's message

    def sync(self, request: DraftRequest) -> object:
        """The request's state, holding every token it has."""
        raise NotImplementedError

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """Build the prefilled requests' state from their prompts (under the prefill's forward)."""
        for request in requests:
            with isolated(request, self.building):
                self.sync(request)

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """Nothing: the state reads tokens only."""

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """Nothing: the state takes the verified tokens at its next proposal."""

    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """Nothing: the next proposal needs the verified tokens on the host."""

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        return False

    def can_admit(self, request: DraftRequest) -> bool:
        return True  # (host memory)

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        return True

    def pools(self) -> list[CachePoolProtocol]:
        return []
