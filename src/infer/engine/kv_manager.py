"""KVManager: the memory every request holds, owned by the scheduler.

Admission and growth of the target's KV pool and of the pools other parts keep per request
(`KVHolder`, e.g. a draft model's). A part whose prompt state must survive a prefix-cache hit
(an EAGLE head's KV) registers a `PrefixRestorer`: the hit is taken only as far as it restores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from infer.cache.protocol import CachePoolProtocol
from infer.engine.request import Request


class KVHolder(Protocol):
    """Per-request memory besides the target's (a draft model's pool)."""

    def can_admit(self, request: Request) -> bool:
        """Whether its memory could hold the request's prompt."""
        ...

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        """Room for positions < total_tokens; False (nothing taken) when memory is short."""
        ...

    def release(self, request: Request) -> None:
        """The request finished or was preempted: drop its state and memory."""
        ...

    def pools(self) -> list[CachePoolProtocol]: ...

    def leak_report(self) -> list[str]: ...


class PrefixRestorer(Protocol):
    """Per-request state of the prompt that a prefix-cache hit must restore, not skip."""

    def restorable(self, request: Request) -> int:
        """How many leading prompt tokens it could restore now (whole blocks)."""
        ...

    def restore(self, request: Request, tokens: int) -> None:
        """Take its state of the first `tokens` prompt tokens (<= `restorable`)."""
        ...


# how many requests decode this step -> (a request -> the positions its next step may write, largest first)
DecodeWidths = Callable[[int], Callable[[Request], list[int]]]


def plain_step(request: Request) -> list[int]:
    """A plain step's widths: one position, whatever the request."""
    return [1]


class KVManager:
    def __init__(self, pool: CachePoolProtocol, prefix_caching: bool, widths: DecodeWidths | None = None) -> None:
        """pool: the target's; widths: the blocks a request's next decode step may write,
        largest first, ending with 1 (a plain step); None: always 1 (no speculation)."""
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.widths = widths
        self.holders: list[KVHolder] = []
        self.restorers: list[PrefixRestorer] = []

    def register(self, holder: KVHolder) -> None:
        self.holders.append(holder)

    def register_restorer(self, restorer: PrefixRestorer) -> None:
        self.restorers.append(restorer)

    def can_admit(self, request: Request) -> bool:
        return self.pool.can_allocate(request.prefill_target) and all(h.can_admit(request) for h in self.holders)

    def allocate(self, request: Request) -> None:
        """The request's target slot, with the cached prefix of its prompt counted as computed
        (no more than every restorer restores)."""
        prefix = request.prompt_token_ids if self.prefix_caching else None
        limit = min((r.restorable(request) for r in self.restorers), default=None) if prefix else None
        request.slot = self.pool.allocate_slot(request.prefill_target, prefix, limit)
        request.num_computed_tokens = self.pool.seq_len(request.slot)
        for restorer in self.restorers:
            restorer.restore(request, request.num_computed_tokens)

    def decode_widths(self, batch: int) -> Callable[[Request], list[int]]:
        """When `batch` requests decode: a request -> the positions its next decode step may write,
        largest first; the last is 1 (a plain step)."""
        return plain_step if self.widths is None else self.widths(batch)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        """Room for positions < total_tokens in every pool; False when memory is short. A plain
        step (one position) grows no holder's memory."""
        assert request.slot is not None
        return self.pool.ensure_capacity(request.slot, total_tokens) and (
            total_tokens <= request.num_computed_tokens + 1
            or all(h.ensure_capacity(request, total_tokens - 1) for h in self.holders))

    def release(self, request: Request) -> None:
        for holder in self.holders:
            holder.release(request)
        if request.slot is not None:
            self.pool.free_slot(request.slot)
            request.slot = None

    def pools(self) -> list[CachePoolProtocol]:
        """Every pool requests hold memory in (the target's first)."""
        return [self.pool] + [p for h in self.holders for p in h.pools()]

    def capacity_tokens(self) -> int | None:
        """Tokens the smallest pool holds (None: unbounded, e.g. slotted pools)."""
        caps = [c for c in (p.total_token_capacity() for p in self.pools()) if c is not None]
        return min(caps) if caps else None

    def leak_report(self) -> list[str]:
        return self.pool.leak_report() + [line for h in self.holders for line in h.leak_report()]
