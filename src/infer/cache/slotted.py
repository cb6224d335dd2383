"""SlottedKVCache: contiguous KV storage, one max_seq_len region per slot.

Memory is reserved for the worst case, so `free_token_capacity()` is None and admission is
limited by slots alone; rollback just lowers the slot's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.cache.block_tables import BlockTables
from infer.cache.row_pool import RowPool
from infer.models.config import ModelConfig
from infer.models.kernels.arrivals import ArrivalCounters


class SlottedKVCache(RowPool):
    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError("max_batch_size and max_seq_len must be >= 1")
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.scratch_row = max_batch_size * max_seq_len  # one extra row: padding writes land here
        shape = (config.num_hidden_layers, self.scratch_row + 1,
                 config.num_key_value_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._lens: dict[int, int] = {}
        self._free = list(range(max_batch_size - 1, -1, -1))
        # as block tables: one block of max_seq_len positions a slot, its own
        self.block_size = max_seq_len
        self.tables = BlockTables(max_batch_size, 1, device)
        self.arrivals = ArrivalCounters(device)  # (allocated at the first split-KV pass)
        for slot in range(max_batch_size):
            self.tables.set(slot, 0, [slot])

    # -- slots -------------------------------------------------------------------------
    def allocate_slot(self, initial_tokens: int = 0, prefix_token_ids: Sequence[int] | None = None,
                      max_cached_tokens: int | None = None) -> int:
        if initial_tokens > self.max_seq_len:
            raise RuntimeError(f"{initial_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        if not self._free:
            raise RuntimeError("no free KV cache slot (all max_batch_size slots are in use)")
        slot = self._free.pop()
        self._lens[slot] = 0
        return slot

    def can_allocate(self, num_tokens: int) -> bool:
        return bool(self._free) and num_tokens <= self.max_seq_len

    def free_slot(self, slot: int) -> None:
        if slot not in self._lens:
            raise KeyError(f"slot {slot} is not allocated")
        del self._lens[slot]
        self._free.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def truncate_to(self, slot: int, new_seq_len: int) -> None:
        if not 0 <= new_seq_len <= self._lens[slot]:
            raise ValueError(f"truncate_to({new_seq_len}) outside 0..{self._lens[slot]}")
        self._lens[slot] = new_seq_len

    def ensure_capacity(self, slot: int, total_tokens: int) -> bool:
        if total_tokens > self.max_seq_len:
            raise RuntimeError(f"slot {slot}: {total_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        return True

    def free_token_capacity(self) -> int | None:
        return None

    def total_token_capacity(self) -> int | None:
        return None

    def register_prefix(self, slot: int, token_ids: Sequence[int]) -> None:
        return None  # no prefix sharing in contiguous storage

    def cached_prefix(self, prefix_token_ids: Sequence[int]) -> int:
        return 0

    def cache_prefixes(self, lookahead: int = 0) -> None:
        raise ValueError("contiguous KV storage shares no prefixes: use kv_cache_backend='paged'")

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def leak_report(self) -> list[str]:
        return [f"slot {s} still allocated ({n} tokens)" for s, n in sorted(self._lens.items())]

    # -- views -------------------------------------------------------------------------
    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """CPU [end - start] storage rows of positions start..end-1."""
        base = slot * self.max_seq_len
        return torch.arange(base + start, base + end)

