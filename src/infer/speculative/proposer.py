"""Proposer protocol: where draft tokens come from (a draft model, an n-gram table).

A proposer sees the running requests and proposes up to k tokens for each. It keeps any
per-request state of its own (a draft KV cache, n-gram tables), is told how many of its
tokens were accepted so it can roll that state back, and when a request leaves. Tree
speculation asks for a draft tree instead (`propose_tree`, `on_tree_accepted`).
Every hook the speculative runners call is declared here: a new proposer implements this
protocol and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.engine.request import Request
    from infer.speculative.tree import TreeDraft, TreeShape


@dataclass(frozen=True, slots=True)
class Draft:
    token_ids: list[int]  # [k], k may be 0 (no proposal -> a plain decode step for this request)
    probs: torch.Tensor | None  # [k, vocab] after the request's sampling transforms;
    # None = deterministic proposal (n-gram), treated as one-hot


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ks[i] tokens continuing requests[i].all_token_ids (ks[i] = 0: none)."""
        ...

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """After verification, `num_accepted` of the round's drafted tokens kept (the target's
        cache is rolled back already; the tokens reach the request's output after this call)."""
        ...

    def propose_tree(self, requests: Sequence[Request], shape: TreeShape, depths: Sequence[int]) -> list[TreeDraft]:
        """Tree speculation: one draft over `shape` per request, no node deeper than
        depths[i] (0: an empty draft). A model's draft writes node i of requests[i] at
        storage position n + 1 + i of its own cache (g at n), like the target's verification."""
        ...

    def on_tree_accepted(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        """After a tree verification of these requests, before their tokens are emitted:
        paths[i], the accepted node indices of requests[i] in depth order. A model's cache
        moves the paths into sequence order and drops the rest (`cache.compaction`)."""
        ...

    def prefilled(self, requests: Sequence[Request]) -> None:
        """A prefill forward for these requests was just queued: host work that helps their
        first proposals can run now, under the forward (n-gram: build the prompt's table)."""
        ...

    def release(self, request: Request) -> None:
        """The request finished or was preempted: drop its state and memory."""
        ...

    def can_admit(self, request: Request) -> bool:
        """Whether the proposer's own memory could hold the request's prompt."""
        ...

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        """Room for positions < total_tokens of the request; False (nothing taken) when
        memory is short: the scheduler preempts."""
        ...

    def pools(self) -> list[CachePoolProtocol]:
        """KV pools the proposer owns (a draft model's), for capacity checks and reports."""
        ...

    def leak_report(self) -> list[str]:
        """State still held (when no request should be running)."""
        ...
