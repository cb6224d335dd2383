"""PagedKVCachePool: KV storage in fixed-size blocks, block tables per slot, prefix caching.

Position p of a slot is row `table[p // block_size] * block_size + p % block_size`. With prefix
caching, full prompt blocks go into a `PrefixTree`; a slot's shared blocks lead its table and
are never written. docs/architecture.md, "Model, kernels and attention".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from infer.cache.allocator import BlockAllocator
from infer.cache.block_tables import BlockTables
from infer.cache.prefix import PrefixTree
from infer.cache.row_pool import RowPool
from infer.models.config import ModelConfig
from infer.models.kernels.arrivals import ArrivalCounters


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys plus values for one block across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def resolve_num_blocks(config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                       block_size: int, num_blocks: int | None, memory_budget_bytes: int | None) -> int:
    """num_blocks as given, else what memory_budget_bytes holds, else max_batch_size full sequences."""
    if num_blocks is not None and memory_budget_bytes is not None:
        raise ValueError("pass num_blocks or memory_budget_bytes, not both")
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return num_blocks
    if memory_budget_bytes is not None:
        per_block = bytes_per_block(config, block_size, dtype)
        if memory_budget_bytes < per_block:
            raise ValueError(f"memory_budget_bytes={memory_budget_bytes} is below one KV block "
                             f"({per_block} bytes); raise it or lower block_size")
        return memory_budget_bytes // per_block
    return max_batch_size * -(-max_seq_len // block_size)


class PagedKVCachePool(RowPool):
    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str, block_size: int = 16, num_blocks: int | None = None,
                 memory_budget_bytes: int | None = None, enable_prefix_caching: bool = False) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                            ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.num_blocks = resolve_num_blocks(config, max_batch_size, max_seq_len, dtype, block_size,
                                             num_blocks, memory_budget_bytes)
        self.enable_prefix_caching = enable_prefix_caching
        self.scratch_row = self.num_blocks * block_size  # one extra row: padding writes land here
        shape = (config.num_hidden_layers, self.scratch_row + 1,
                 config.num_key_value_heads, config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, Hkv, D]
        self.tables = BlockTables(max_batch_size, self._blocks_for(max_seq_len), device)  # every slot's, on the device
        self.arrivals = ArrivalCounters(device)  # (allocated at the first split-KV pass)
        self._allocator = BlockAllocator(self.num_blocks)
        self._tree = PrefixTree(block_size)
        self._tables: dict[int, list[int]] = {}  # slot -> block ids, position order
        self._shared: dict[int, int] = {}  # slot -> leading table entries owned by the prefix tree
        self._lens: dict[int, int] = {}
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self.prefix_query_tokens = 0  # prompt tokens offered for prefix matching
        self.prefix_hit_tokens = 0  # of those, tokens served from cached blocks

    def cache_prefixes(self, lookahead: int = 0) -> None:
        """Turn prefix caching on in an idle pool, each block keyed by its tokens and `lookahead` more."""
        if self.enable_prefix_caching and lookahead == self._tree.lookahead:
            return
        if self._tables or len(self._tree):
            raise RuntimeError("prefix caching is switched on in an idle pool only (no slot, no cached block)")
        self._tree = PrefixTree(self.block_size, lookahead)
        self.enable_prefix_caching = True

    # -- slots -------------------------------------------------------------------------
    def allocate_slot(self, initial_tokens: int = 0, prefix_token_ids: Sequence[int] | None = None,
                      max_cached_tokens: int | None = None) -> int:
        if initial_tokens < 0:
            raise ValueError(f"initial_tokens must be >= 0, got {initial_tokens}")
        if initial_tokens > self.max_seq_len:
            raise RuntimeError(f"{initial_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        if not self._free_slots:
            raise RuntimeError("no free KV cache slot (all max_batch_size slots are in use)")
        matched = self._match(prefix_token_ids, max_cached_tokens)
        cached = len(matched) * self.block_size
        need = self._blocks_for(max(initial_tokens, cached)) - len(matched)
        pinned = sum(self._tree.refcount(b) == 0 for b in matched)  # evictable now, not once held
        if need > self._allocator.num_free + self._tree.num_evictable - pinned:
            raise RuntimeError(f"out of KV cache blocks: {need} needed for {initial_tokens} tokens "
                               f"(check can_allocate first)")
        self._tree.acquire(matched)
        fresh = self._take(need)
        assert fresh is not None, "block accounting is wrong: counted blocks were not there"
        slot = self._free_slots.pop()
        self._tables[slot], self._shared[slot], self._lens[slot] = matched + fresh, len(matched), cached
        self.tables.set(slot, 0, self._tables[slot])
        if prefix_token_ids is not None and self.enable_prefix_caching:
            self.prefix_query_tokens += len(prefix_token_ids)
            self.prefix_hit_tokens += cached
        return slot

    def _match(self, prefix_token_ids: Sequence[int] | None, max_cached_tokens: int | None = None) -> list[int]:
        """Cached full blocks of the prompt, leaving at least its last token to compute (and
        no more than max_cached_tokens)."""
        if not self.enable_prefix_caching or not prefix_token_ids:
            return []
        limit = len(prefix_token_ids) - 1 if max_cached_tokens is None else min(len(prefix_token_ids) - 1,
                                                                                 max_cached_tokens)
        return self._tree.match(prefix_token_ids, limit // self.block_size)

    def cached_prefix(self, prefix_token_ids: Sequence[int]) -> int:
        """Tokens of the prompt that `allocate_slot` would take from the prefix cache now."""
        return len(self._match(prefix_token_ids)) * self.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        """A slot and blocks for num_tokens (evictable cached blocks count as free)."""
        return (bool(self._free_slots) and num_tokens <= self.max_seq_len
                and self._blocks_for(num_tokens) <= self._allocator.num_free + self._tree.num_evictable)

    def free_slot(self, slot: int) -> None:
        table, shared = self._slot_table(slot), self._shared[slot]
        self._tree.release(table[:shared])
        self._allocator.release(table[shared:])
        del self._tables[slot], self._shared[slot], self._lens[slot]
        self._free_slots.append(slot)

    def seq_len(self, slot: int) -> int:
        self._slot_table(slot)
        return self._lens[slot]

    def block_table(self, slot: int) -> list[int]:
        """A copy of the slot's block ids, in position order."""
        return list(self._slot_table(slot))

    def num_shared_blocks(self, slot: int) -> int:
        """Leading blocks of the slot's table that belong to the prefix cache (read-only)."""
        self._slot_table(slot)
        return self._shared[slot]

    def truncate_to(self, slot: int, new_seq_len: int) -> None:
        """Forget positions >= new_seq_len; free blocks with index >= ceil(new_seq_len / block_size)."""
        table, current = self._slot_table(slot), self._lens[slot]
        if not 0 <= new_seq_len <= current:
            raise ValueError(f"truncate_to({new_seq_len}) outside 0..{current} for slot {slot}")
        shared_tokens = self._shared[slot] * self.block_size
        if new_seq_len < shared_tokens:
            raise RuntimeError(f"slot {slot}: truncate_to({new_seq_len}) would cut into shared prefix "
                               f"blocks (cached prompt tokens 0..{shared_tokens - 1} are read-only)")
        keep = self._blocks_for(new_seq_len)
        self._allocator.release(table[keep:])
        del table[keep:]
        self._lens[slot] = new_seq_len

    def ensure_capacity(self, slot: int, total_tokens: int) -> bool:
        """Give positions < total_tokens rows, evicting unreferenced cached blocks if needed.
        False (nothing allocated) when blocks are still short: the scheduler preempts."""
        table = self._slot_table(slot)
        if total_tokens > self.max_seq_len:
            raise RuntimeError(f"slot {slot}: {total_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        need = self._blocks_for(total_tokens) - len(table)
        if need <= 0:
            return True
        fresh = self._take(need)
        if fresh is None:
            return False
        self.tables.set(slot, len(table), fresh)
        table.extend(fresh)
        return True

    def total_token_capacity(self) -> int:
        """Tokens the whole pool can hold (the most one request can ever use)."""
        return self.num_blocks * self.block_size

    def free_token_capacity(self) -> int | None:
        return (self._allocator.num_free + self._tree.num_evictable) * self.block_size

    def register_prefix(self, slot: int, token_ids: Sequence[int]) -> None:
        """Offer the slot's full, already computed prompt blocks to the prefix cache. A block
        cached meanwhile by another sequence wins: the slot switches to it, its copy is freed."""
        table = self._slot_table(slot)
        if not self.enable_prefix_caching:
            return
        start = self._shared[slot]
        full = min(self._tree.num_keyed(len(token_ids)), self._lens[slot] // self.block_size)
        parent = table[start - 1] if start else None
        for i in range(start, full):
            tokens = self._tree.key_tokens(token_ids, i)
            existing = self._tree.lookup(parent, tokens)
            if existing is None:
                self._tree.insert(parent, tokens, table[i])
            else:
                self._tree.acquire([existing])
                self._allocator.release([table[i]])
                table[i] = existing
                self.tables.set(slot, i, [existing])
            parent = table[i]
        self._shared[slot] = max(start, full)

    # -- blocks ------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting unreferenced cached blocks first if the free list is short."""
        short = n - self._allocator.num_free
        if short > 0:
            if short > self._tree.num_evictable:
                return None
            self._allocator.release(self._tree.evict(short))
        return self._allocator.take(n)

    def _slot_table(self, slot: int) -> list[int]:
        table = self._tables.get(slot)
        if table is None:
            raise KeyError(f"slot {slot} is not allocated")
        return table

    # -- stats -------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return self._allocator.num_free

    def is_block_free(self, block: int) -> bool:
        """On the free list (cached-but-unreferenced prefix blocks are not)."""
        return self._allocator.is_free(block)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (referenced or not)."""
        return len(self._tree)

    @property
    def num_evictable_blocks(self) -> int:
        return self._tree.num_evictable

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def leak_report(self) -> list[str]:
        """Problems when the pool should be idle (and accounting errors at any time)."""
        problems = [f"slot {s} still allocated ({n} tokens, {len(self._tables[s])} blocks)"
                    for s, n in sorted(self._lens.items())]
        private = sum(len(t) - self._shared[s] for s, t in self._tables.items())
        references = Counter(b for s, t in self._tables.items() for b in t[:self._shared[s]])
        referenced = len(references)
        held = self.num_blocks - self._allocator.num_free - self._tree.num_evictable
        if held != private + referenced:
            problems.append(f"{held - private - referenced} blocks are neither free, cached unreferenced, "
                            f"nor in a slot's table")
        for block in self._tree.blocks():
            if self._tree.refcount(block) != references.get(block, 0):
                problems.append(f"prefix block {block}: refcount {self._tree.refcount(block)} but "
                                f"{references.get(block, 0)} slots use it")
        if any(self._allocator.is_free(b) for b in self._tree.blocks()):
            problems.append("a prefix cache block is also on the free list")
        return problems + self._allocator.check() + self._tree.check()

    # -- storage rows ------------------------------------------------------------------
    def rows(self, slot: int, start: int, end: int) -> torch.Tensor:
        """CPU [end - start] storage rows of positions start..end-1 (blocks allocated)."""
        size = self.block_size
        table = torch.tensor(self._tables[slot][:self._blocks_for(end)], dtype=torch.long)
        positions = torch.arange(start, end)
        return table[positions // size] * size + positions % size

