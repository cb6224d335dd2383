"""BlockAllocator: the free list of KV cache blocks (integer ids) for the paged pool.

Allocation is all-or-nothing; releasing a free block raises. The lowest free ids go first
(a min-heap), so where a sequence's blocks land does not depend on what ran before.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap: the lowest free id first
        self._is_free: list[bool] = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]

    def take(self, n: int) -> list[int] | None:
        """n free blocks, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        taken = [heapq.heappop(self._free) for _ in range(n)]
        for block in taken:
            self._is_free[block] = False
        return taken

    def release(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list; a block that is already free raises RuntimeError."""
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise RuntimeError(f"block {block} is outside 0..{self.num_blocks - 1}")
            if self._is_free[block]:
                raise RuntimeError(f"block {block} released twice (it is already free)")
            self._is_free[block] = True
            heapq.heappush(self._free, block)

    def check(self) -> list[str]:
        """Internal consistency problems (empty when the free list is sound)."""
        problems = []
        if len(set(self._free)) != len(self._free):
            problems.append("free list holds a block more than once")
        if sum(self._is_free) != len(self._free):
            problems.append("free flags disagree with the free list")
        return problems
