"""PrefixTree: cached prompt blocks shared between requests, with reference counts.

Each node is one full block keyed by (parent node, its tokens), so it stands for the whole
prefix. A referenced node's ancestors are referenced too, so eviction takes the least
recently used unreferenced leaf. docs/architecture.md, "Model, kernels and attention".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Key = tuple[int, tuple[int, ...]]  # (parent block or -1 at the root, the block's tokens)


@dataclass(slots=True)
class _Node:
    block: int
    key: Key
    refcount: int = 0
    children: int = 0
    last_used: int = 0


class PrefixTree:
    def __init__(self, block_size: int, lookahead: int = 0) -> None:
        """lookahead: tokens after a block that its key holds (its block's content depends on them)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.block_size, self.lookahead = block_size, lookahead
        self._by_key: dict[Key, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._heap: list[tuple[int, int]] = []  # (last_used, block) of candidate leaves
        self._clock = 0
        self._unreferenced = 0

    # -- queries -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_block)

    def __contains__(self, block: int) -> bool:
        return block in self._by_block

    @property
    def num_evictable(self) -> int:
        """Nodes no sequence references (all of them can be evicted, leaves first)."""
        return self._unreferenced

    def refcount(self, block: int) -> int:
        return self._by_block[block].refcount

    def blocks(self) -> list[int]:
        return list(self._by_block)

    def lookup(self, parent: int | None, tokens: Sequence[int]) -> int | None:
        node = self._by_key.get(_key(parent, tokens))
        return None if node is None else node.block

    def key_tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        """The tokens of block `index`'s key: its own and the lookahead after it."""
        return token_ids[index * self.block_size:(index + 1) * self.block_size + self.lookahead]

    def num_keyed(self, num_tokens: int) -> int:
        """Blocks whose whole key lies in the first num_tokens tokens."""
        return max(0, num_tokens - self.lookahead) // self.block_size

    def match(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached chain of full blocks of token_ids (at most
        max_blocks). Reference counts are unchanged; `acquire` the result to use it."""
        parent, found = None, []
        for i in range(min(max_blocks, self.num_keyed(len(token_ids)))):
            block = self.lookup(parent, self.key_tokens(token_ids, i))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    # -- references ----------------------------------------------------------------------
    def acquire(self, blocks: Iterable[int]) -> None:
        tick = self._tick()
        for block in blocks:
            node = self._by_block[block]
            if node.refcount == 0:
                self._unreferenced -= 1
            node.refcount += 1
            node.last_used = tick

    def release(self, blocks: Iterable[int]) -> None:
        tick = self._tick()
        for block in blocks:
            node = self._by_block[block]
            if node.refcount <= 0:
                raise RuntimeError(f"prefix block {block} released more often than acquired")
            node.refcount -= 1
            node.last_used = tick
            if node.refcount == 0:
                self._unreferenced += 1
                self._push_if_leaf(node)

    def insert(self, parent: int | None, tokens: Sequence[int], block: int) -> None:
        """Add `block` (full, holding `tokens` after the chain ending at `parent`, then the
        lookahead) with one reference: the sequence that computed it. The caller holds `parent`."""
        if len(tokens) != self.block_size + self.lookahead:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} of {self.block_size} tokens"
                             + (f" and {self.lookahead} after them" if self.lookahead else ""))
        key = _key(parent, tokens)
        if key in self._by_key:
            raise RuntimeError("this prefix block is already cached; lookup() before insert()")
        if block in self._by_block:
            raise RuntimeError(f"block {block} is already a prefix tree node")
        if parent is not None:
            self._by_block[parent].children += 1
        node = _Node(block, key, refcount=1, last_used=self._tick())
        self._by_key[key] = node
        self._by_block[block] = node

    # -- eviction ------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Remove up to n unreferenced nodes, least recently used leaf first; their blocks."""
        evicted: list[int] = []
        while len(evicted) < n and self._heap:
            last_used, block = heapq.heappop(self._heap)
            node = self._by_block.get(block)
            if node is None or node.refcount or node.children or node.last_used != last_used:
                continue  # stale entry
            self._remove(node)
            evicted.append(block)
        return evicted

    def _remove(self, node: _Node) -> None:
        del self._by_key[node.key]
        del self._by_block[node.block]
        self._unreferenced -= 1
        parent_block = node.key[0]
        if parent_block >= 0:
            parent = self._by_block[parent_block]
            parent.children -= 1
            self._push_if_leaf(parent)

    def _push_if_leaf(self, node: _Node) -> None:
        if node.refcount == 0 and node.children == 0:
            heapq.heappush(self._heap, (node.last_used, node.block))
            if len(self._heap) > 2 * len(self._by_block) + 64:
                self._compact_heap()

    def _compact_heap(self) -> None:
        self._heap = [(n.last_used, n.block) for n in self._by_block.values()
                      if n.refcount == 0 and n.children == 0]
        heapq.heapify(self._heap)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def check(self) -> list[str]:
        """Internal consistency problems (empty when the tree is sound)."""
        problems = []
        children: dict[int, int] = {}
        for node in self._by_block.values():
            parent = node.key[0]
            if parent >= 0:
                if parent not in self._by_block:
                    problems.append(f"prefix block {node.block} has no parent node {parent}")
                    continue
                children[parent] = children.get(parent, 0) + 1
                if node.refcount > self._by_block[parent].refcount:
                    problems.append(f"prefix block {node.block} is referenced more than its parent")
        for node in self._by_block.values():
            if node.children != children.get(node.block, 0):
                problems.append(f"prefix block {node.block}: child count {node.children} is wrong")
        if self._unreferenced != sum(n.refcount == 0 for n in self._by_block.values()):
            problems.append("unreferenced node count is wrong")
        return problems


def _key(parent: int | None, tokens: Sequence[int]) -> Key:
    return (-1 if parent is None else parent, tuple(tokens))
