"""Proposer protocol: where draft tokens come from (a draft model, n-gram tables).

A proposer sees the running requests and proposes a draft over the round's shape for each:
a chain (`chain_shape(K)`, row i using its first depths[i] nodes) or a static tree. It keeps
any per-request state of its own (a draft KV cache, n-gram tables), is told which nodes were
accepted so it can roll that state back, and when a request leaves. Every hook the runner
calls is declared here: a new proposer implements this protocol and nothing else.

`DraftRequest` is what a proposer may read of a request (the engine's `Request` has it),
so this layer never imports the engine.
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
        """One draft over `shape` per request, no node deeper than depths[i] (0: an empty
        draft). A chain shape's draft for row i is its first depths[i] nodes (or fewer). A
        model's draft writes node j of requests[i] at storage position n + 1 + j of its own
        cache (g at n), like the target's verification."""
        ...

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """After verification, before the tokens are emitted: paths[i], the accepted node
        indices of requests[i] in depth order (a chain: 0 .. a-1). A model's cache moves the
        paths into sequence order and drops the rest (`cache.compaction`). For a round whose
        next round already runs (`can_follow`), the host's positions past it are corrected
        instead, and `observed` does not follow (its rows were fed by that next round)."""
        ...

    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """A round of chains is being verified on the device, the host not yet knowing the
        outcome: verdict [B, K + 2] long (each row's accepted drafts, their count a at
        column K, the final token last; `verify_on_logits`), starts[i] the token of the
        forward where requests[i]'s block begins. A proposer may queue its next round's
        drafts now, under the GPU work the host waits for (an EAGLE head and a draft model:
        their greedy rows); the others do nothing. `on_accepted` follows."""
        ...

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        """Whether the requests' next round, a chain of k each, is drafted already on the
        device following the round in flight (`verifying`), so that it may be queued before
        the host reads that round's verdict: the runner then builds its rows from the
        verdict on the device (docs/speculation.md, "Rounds in flight"). False for a
        proposer that drafts from tokens on the host."""
        ...

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """A prefill forward for these requests was just queued: work that helps their first
        proposals can run now, under the forward (n-gram: build the prompt's table; an EAGLE
        head sharing prefixes: feed the chunk's features)."""
        ...

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """The target's forward just ran and committed, for requests[i], the forward's
        tokens rows[i] (their indices in its flat batch) at positions starts[i], starts[i] + 1,
        ... (a prefill chunk: all its tokens; a plain step: its one; a round: g's and the
        accepted nodes'). A proposer drafting from the target's hidden states (EAGLE) reads
        them now from the model's `HiddenCapture`; others do nothing."""
        ...

    def release(self, request: DraftRequest) -> None:
        """The request finished or was preempted: drop its state and memory."""
        ...

    def can_admit(self, request: DraftRequest) -> bool:
        """Whether the proposer's own memory could hold the request's prompt."""
        ...

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        """Room for positions < total_tokens of the request; False (nothing taken) when
        memory is short: the scheduler preempts. Memory a proposer keeps per request is
        taken at the request's first round; with `take` (the request drafts in every
        round: a fixed K) it is taken now, at the scheduler's reservation, so a round never
        finds it short."""
        ...

    def pools(self) -> list[CachePoolProtocol]:
        """KV pools the proposer owns (a draft model's), for capacity checks and reports."""
        ...

    def leak_report(self) -> list[str]:
        """State still held (when no request should be running)."""
        ...


class HostProposer:
    """The hooks of a proposer whose state is host memory made from the requests' verified
    tokens alone (n-gram tables, suffix tries): the state is brought up to date (`sync`) at
    each proposal and from the prompt under its prefill's forward; nothing to read of the
    forward, nothing to roll back, no device memory."""

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
