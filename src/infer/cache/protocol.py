"""CachePoolProtocol: what the runners need from a KV cache pool.

A pool owns KV storage for one model and hands out slots, one per running sequence. The
runner asks for a view per forward pass (prefill, right-padded batched prefill, chunks after
a cached prefix, decode, speculative verification are all one call with different
start positions and chunk lengths), runs the model through it, then `commit()`s the view
to advance the slots' lengths. `truncate_to` rolls a slot back (speculative rejection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from infer.cache.view import BatchLayout, CacheView, PackedView, ViewIndices


class CachePoolProtocol(Protocol):
    max_batch_size: int
    max_seq_len: int

    def allocate_slot(self, initial_tokens: int = 0, prefix_token_ids: Sequence[int] | None = None,
                      max_cached_tokens: int | None = None) -> int:
        """Reserve a slot with room for `initial_tokens`. With prefix caching, reuse cached
        blocks of `prefix_token_ids` (at most `max_cached_tokens`); `seq_len(slot)` then says
        how many are already cached. Raises RuntimeError when out of slots or memory (check
        `can_allocate` first)."""
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

    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """CPU LongTensor [end - start]: storage rows of positions start..end-1."""
        ...

    def indices(self, layout: BatchLayout, context_width: int | None = None,
                out: ViewIndices | None = None) -> ViewIndices:
        """Validated host-side index tensors for a forward pass (capacity must be ensured);
        filled into `out` when given (see `view.layout_indices`)."""
        ...

    def commit(self, layout: BatchLayout) -> None:
        """Set each slot's length to the end of its chunk (after the forward pass)."""
        ...

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the keys and values of storage rows `src` to rows `dst` (every layer; every
        source is read before any destination is written). Tree speculation's compaction."""
        ...

    def view(self, layout: BatchLayout) -> CacheView | PackedView:
        """The attention view for one eager forward pass; `view.commit()` calls `commit`."""
        ...

    def leak_report(self) -> list[str]:
        """Problems when the pool should be idle: slots in use, blocks held, refcounts > 0."""
        ...
