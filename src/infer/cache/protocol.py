"""CachePoolProtocol: what the runners need from a KV cache pool.

A pool owns KV storage for one model and hands out slots, one per running sequence; a flat
forward's KV slots come from its block tables, and `truncate_to` rolls a slot back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from infer.cache.block_tables import BlockTables
from infer.models.kernels.arrivals import ArrivalCounters


class CachePoolProtocol(Protocol):
    max_batch_size: int
    max_seq_len: int

    def allocate_slot(self, initial_tokens: int = 0, prefix_token_ids: Sequence[int] | None = None,
                      max_cached_tokens: int | None = None) -> int:
        """Reserve a slot with room for `initial_tokens`, reusing cached blocks of `prefix_token_ids`
        (at most `max_cached_tokens`; `seq_len(slot)` says how many). RuntimeError when out of slots
        or memory."""
        ...

    def cached_prefix(self, prefix_token_ids: Sequence[int]) -> int:
        """Tokens of the prompt that `allocate_slot` would take from the prefix cache now."""
        ...

    def cache_prefixes(self, lookahead: int = 0) -> None:
        """Switch prefix caching on (an idle pool), blocks keyed with `lookahead` tokens after them."""
        ...

    def can_allocate(self, num_tokens: int) -> bool: ...

    def free_slot(self, slot: int) -> None: ...

    def seq_len(self, slot: int) -> int:
        """Tokens whose keys and values are in the cache for this slot."""
        ...

    def truncate_to(self, slot: int, new_seq_len: int) -> None:
        """Forget positions >= new_seq_len (paged: free blocks wholly past the new end)."""
        ...

    def ensure_capacity(self, slot: int, total_tokens: int) -> bool:
        """Make room for positions < total_tokens; False when memory is short (preempt)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens that can still be allocated (None for the contiguous backend)."""
        ...

    def total_token_capacity(self) -> int | None:
        """Tokens the whole pool can hold (None for the contiguous backend)."""
        ...

    def register_prefix(self, slot: int, token_ids: Sequence[int]) -> None:
        """After a prompt is fully cached: offer its full blocks to the prefix cache."""
        ...

    k_cache: torch.Tensor  # [layers, rows + 1, kv_heads, head_dim]; the last row is scratch
    v_cache: torch.Tensor
    scratch_row: int
    block_size: int
    tables: BlockTables  # every slot's block table, on the pool's device
    arrivals: ArrivalCounters  # the split-KV attention's counters for every pass over the pool

    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """CPU LongTensor [end - start]: storage rows of positions start..end-1."""
        ...

    def set_length(self, slot: int, length: int) -> None:
        """The slot holds positions < length (after a forward pass wrote them)."""
        ...

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of storage rows `src` to rows `dst` (every layer; sources read before any write)."""
        ...

    def leak_report(self) -> list[str]:
        """Problems when the pool should be idle: slots in use, blocks held, refcounts > 0."""
        ...
