"""Proposer protocol: where draft tokens come from (a draft model, an n-gram table).

A proposer sees the running requests and proposes up to k tokens for each. It keeps any
per-request state of its own (a draft KV cache, n-gram tables) and is told how many of its
tokens were accepted so it can roll that state back, and when a request leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from infer.engine.request import Request


@dataclass(frozen=True, slots=True)
class Draft:
    token_ids: list[int]  # [k], k may be 0 (no proposal -> a plain decode step for this request)
    probs: torch.Tensor | None  # [k, vocab] after the request's sampling transforms;
    # None = deterministic proposal (n-gram), treated as one-hot


class Proposer(Protocol):
    # wall time the last propose() spent catching its state up on tokens of plain steps
    # (0.0 if none): the adaptive policy's cost of switching back to speculation. A
    # proposer whose catch-up grows with the gap may also expose `catch_up_chunks` (units
    # of work the last catch-up took, summed over its requests) and
    # `catch_up_units(tokens_behind)` (units one request's gap takes): the cost model then
    # keeps the switch cost per unit and the policy prices a probe by its request's gap and
    # a batch start by the sum of its requests' (the draft model: 128-token chunks)
    catch_up_seconds: float
    # drafts are deterministic (one-hot) and nearly free, so the adaptive policy may take
    # them in shadow during plain steps and compare them with the tokens that follow
    # (spec/shadow.py); a draft model's are neither
    shadow_drafts: bool

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Up to ks[i] tokens continuing requests[i].all_token_ids."""
        ...

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """Called after verification (the request's output already holds the new tokens)."""
        ...

    def release(self, request: Request) -> None:
        """The request finished or was preempted: drop its state and memory."""
        ...
