"""A decode step in flight: the tokens it sampled, or a round's verdict, still on the device.

Overlapped scheduling queues step n+1's GPU work before the host reads step n's tokens:
`InFlight` holds them on the device with a pinned host copy (two buffers used in turn),
`RoundInFlight` a round of chains. docs/architecture.md, "Overlapped scheduling".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infer.engine.request import Request
from infer.engine.verification import Verdict
from infer.logprobs import TokenLogprobs
from infer.speculative.tree import Draft
from infer.transfer import HostCopy, to_device


class TokenBuffers:
    """Two pinned host buffers of `size` token ids and their CUDA events, used in turn by the
    steps' `HostCopy`s (plain tensors and no events on a CPU)."""

    def __init__(self, size: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(size, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self.turn = 0
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        self.turn ^= 1
        return self.buffers[self.turn], self.events[self.turn]


@dataclass
class InFlight:
    """Tokens sampled by one step: one per request, in `requests` order."""

    requests: list[Request]
    tokens: torch.Tensor  # [n] long on the device
    host: HostCopy  # of `tokens`, queued after the sampling
    logprobs: list[TokenLogprobs | None]  # per request (computed eagerly: steps asking for them do not overlap)
    rows: dict[int, int] = field(default_factory=dict)  # id(request) -> row of `tokens`

    @classmethod
    def launch(cls, requests: Sequence[Request], tokens: torch.Tensor, buffers: TokenBuffers,
               logprobs: Sequence[TokenLogprobs | None]) -> InFlight:
        """Queue the copy of `tokens` [n] to a pinned buffer and count them as pending."""
        host = HostCopy(tokens, *buffers.next())
        for r in requests:
            r.pending_tokens += 1
        return cls(list(requests), tokens, host, list(logprobs), {id(r): i for i, r in enumerate(requests)})

    def holds(self, request: Request) -> bool:
        return id(request) in self.rows

    def input_ids(self, requests: Sequence[Request]) -> torch.Tensor:
        """[B, 1] input ids of a decode step on the device: each request's newest token, from
        this step's sampled tokens where it is still in flight."""
        rows = [self.rows.get(id(r), -1) for r in requests]
        if rows == list(range(len(requests))):
            return self.tokens[:len(requests), None]
        plan = torch.tensor([[max(0, x) for x in rows], [x >= 0 for x in rows],  # [3, B]: row, in flight?,
                             [0 if x >= 0 else r.last_token_id for r, x in zip(requests, rows, strict=True)]])  # host id
        src, mine, host_ids = to_device(plan, self.tokens.device)
        return torch.where(mine.bool(), self.tokens.index_select(0, src), host_ids)[:, None]

    def host_tokens(self) -> list[int]:
        """The sampled ids, once this step's work is done (waits for it alone)."""
        return self.host.tolist()


@dataclass
class RoundInFlight:
    """A round of chains whose verdict the host has not read, each row counted as if all k
    drafts were accepted until `ModelRunner._settle` corrects it."""

    requests: list[Request]
    drafts: list[Draft]
    verdict: Verdict
    starts: list[int]  # where each row's block begins in the forward's flat batch
    k: int
