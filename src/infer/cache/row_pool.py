"""RowPool: what the row-indexed KV pools (paged, slotted, a tensor-parallel worker's) share.

KV lives as rows `[layers, rows + 1, kv_heads, head_dim]` (the last row is scratch). A subclass
keeps `_lens` (tokens per slot) and the KV tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.transfer import tensor_on


class RowPool:
    _lens: dict[int, int]

    def set_length(self, slot: int, length: int) -> None:
        """The slot holds positions < length (after a forward pass wrote them)."""
        self._lens[slot] = length

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of storage rows `src` to rows `dst` (every layer; sources read before any write)."""
        k_cache: torch.Tensor = self.k_cache  # type: ignore[attr-defined]  # [layers, rows + 1, Hkv, D]
        v_cache: torch.Tensor = self.v_cache  # type: ignore[attr-defined]
        src_t, dst_t = tensor_on(list(src), k_cache.device, torch.long), tensor_on(list(dst), k_cache.device,
                                                                                   torch.long)  # [M]
        for cache in (k_cache, v_cache):
            cache.index_copy_(1, dst_t, cache.index_select(1, src_t))
