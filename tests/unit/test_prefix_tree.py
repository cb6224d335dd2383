"""BlockAllocator and PrefixTree: pure bookkeeping, no tensors."""

from __future__ import annotations

import pytest

from infer.cache.allocator import BlockAllocator
from infer.cache.prefix import PrefixTree

BS = 4


def build_chain(tree: PrefixTree, tokens: list[int], blocks: list[int]) -> None:
    """Insert tokens (a multiple of BS) as a chain of the given blocks, each held once."""
    parent = None
    for i, block in enumerate(blocks):
        tree.insert(parent, tokens[i * BS:(i + 1) * BS], block)
        parent = block


# -- allocator -------------------------------------------------------------------------
def test_allocator_take_and_release() -> None:
    alloc = BlockAllocator(5)
    got = alloc.take(3)
    assert got is not None and len(set(got)) == 3 and alloc.num_free == 2
    assert all(not alloc.is_free(b) for b in got)
    assert alloc.take(3) is None and alloc.num_free == 2  # all or nothing
    alloc.release(got[:2])
    assert alloc.num_free == 4 and alloc.is_free(got[0]) and not alloc.is_free(got[2])
    assert alloc.check() == []


def test_allocator_hands_out_the_lowest_free_ids_whatever_came_before() -> None:
    # a sequence's blocks land in the same place however the pool was used before (start-up
    # calibration, earlier requests freed in any order): ascending and contiguous when idle
    alloc = BlockAllocator(8)
    first, second = alloc.take(3), alloc.take(2)
    assert first == [0, 1, 2] and second == [3, 4]
    alloc.release(reversed(first))
    alloc.release(second)
    assert alloc.take(4) == [0, 1, 2, 3]
    alloc.release([2, 0])
    assert alloc.take(3) == [0, 2, 4]


def test_allocator_rejects_double_free_and_bad_sizes() -> None:
    alloc = BlockAllocator(2)
    block = alloc.take(1)[0]
    alloc.release([block])
    with pytest.raises(RuntimeError, match="twice"):
        alloc.release([block])
    with pytest.raises(RuntimeError, match="outside"):
        alloc.release([7])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)
    assert alloc.num_free == 2 and alloc.check() == []


# -- prefix tree -----------------------------------------------------------------------
def test_match_follows_the_chain_and_stops_at_a_difference() -> None:
    tree = PrefixTree(BS)
    prompt = list(range(12))
    build_chain(tree, prompt, [10, 11, 12])
    assert tree.match(prompt, 10) == [10, 11, 12]
    assert tree.match(prompt + [99], 10) == [10, 11, 12]
    assert tree.match(prompt, 2) == [10, 11]  # max_blocks cap
    assert tree.match(prompt[:7], 10) == [10]  # only full blocks
    changed = prompt.copy()
    changed[5] = 77
    assert tree.match(changed, 10) == [10]  # no reuse from the differing block on
    assert tree.match([50] + prompt[1:], 10) == []


def test_equal_blocks_after_different_prefixes_do_not_match() -> None:
    tree = PrefixTree(BS)
    build_chain(tree, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1])
    # Second block's tokens equal, first block differs: the chain key must keep them apart.
    assert tree.match([9, 9, 9, 9, 5, 6, 7, 8], 10) == []
    assert tree.lookup(None, [9, 9, 9, 9]) is None
    assert tree.lookup(0, [5, 6, 7, 8]) == 1
    assert tree.lookup(None, [5, 6, 7, 8]) is None


def test_lookahead_keys_hold_the_tokens_after_each_block() -> None:
    # (an EAGLE head's block depends on the token after it: blocks equal up to their end but
    # followed by different tokens are different nodes)
    tree = PrefixTree(BS, lookahead=1)
    prompt = list(range(12))
    tree.insert(None, prompt[0:5], 10)
    tree.insert(10, prompt[4:9], 11)
    assert tree.num_keyed(9) == 2 and tree.num_keyed(8) == 1 and tree.num_keyed(0) == 0
    assert tree.match(prompt, 10) == [10, 11]
    assert tree.match(prompt[:8], 10) == [10]  # block 1's next token unknown: not matched
    assert tree.match(prompt[:8] + [99], 10) == [10]  # a different next token: another node
    tree.insert(10, prompt[4:8] + [99], 12)
    assert tree.match(prompt[:8] + [99], 10) == [10, 12] and tree.match(prompt, 10) == [10, 11]
    with pytest.raises(ValueError, match="1 after them"):
        tree.insert(11, prompt[8:12], 13)
    with pytest.raises(ValueError, match="lookahead"):
        PrefixTree(BS, lookahead=-1)
    assert tree.check() == []


def test_reference_counts_up_and_down() -> None:
    tree = PrefixTree(BS)
    build_chain(tree, list(range(8)), [3, 4])
    assert (tree.refcount(3), tree.refcount(4), tree.num_evictable) == (1, 1, 0)
    tree.acquire([3, 4])
    assert (tree.refcount(3), tree.refcount(4)) == (2, 2)
    tree.release([3, 4])
    tree.release([3, 4])
    assert (tree.refcount(3), tree.refcount(4), tree.num_evictable) == (0, 0, 2)
    with pytest.raises(RuntimeError, match="released more often"):
        tree.release([3])
    assert tree.check() == []


def test_insert_rejects_partial_and_duplicate_blocks() -> None:
    tree = PrefixTree(BS)
    with pytest.raises(ValueError, match="full blocks"):
        tree.insert(None, [1, 2], 0)
    tree.insert(None, [1, 2, 3, 4], 0)
    with pytest.raises(RuntimeError, match="already cached"):
        tree.insert(None, [1, 2, 3, 4], 1)
    with pytest.raises(RuntimeError, match="already a prefix tree node"):
        tree.insert(None, [5, 6, 7, 8], 0)


def test_eviction_is_lru_leaves_first_and_spares_referenced_blocks() -> None:
    tree = PrefixTree(BS)
    build_chain(tree, list(range(8)), [0, 1])  # chain A: 0 -> 1
    build_chain(tree, list(range(100, 108)), [2, 3])  # chain B: 2 -> 3
    build_chain(tree, list(range(200, 204)), [4])  # chain C: 4 (stays referenced)
    tree.release([2, 3])  # B released first: least recently used
    tree.release([0, 1])
    assert tree.num_evictable == 4
    assert tree.evict(1) == [3]  # B's leaf, not its parent 2, not A
    assert tree.evict(2) == [2, 1]  # then B's root, then A's leaf
    assert tree.evict(5) == [0]  # C is referenced: never evicted
    assert 4 in tree and len(tree) == 1 and tree.num_evictable == 0
    assert tree.check() == []


def test_reuse_refreshes_lru_order() -> None:
    tree = PrefixTree(BS)
    build_chain(tree, list(range(4)), [0])
    build_chain(tree, list(range(10, 14)), [1])
    tree.release([0])
    tree.release([1])
    tree.acquire(tree.match(list(range(5)), 1))  # block 0 used again: now the newest
    tree.release([0])
    assert tree.evict(1) == [1]
    assert tree.evict(1) == [0]


def test_parent_with_referenced_child_is_not_evicted() -> None:
    tree = PrefixTree(BS)
    build_chain(tree, list(range(8)), [0, 1])
    tree.insert(0, [20, 21, 22, 23], 2)  # second branch under block 0, held by another sequence
    tree.acquire([0])  # that sequence also holds the root
    tree.release([0, 1])
    assert tree.evict(10) == [1]  # only the unreferenced leaf
    assert 0 in tree and 2 in tree and tree.check() == []
