"""A suffix match's draft tree: the likeliest continuations, best first (SuffixDecoding,
arXiv 2411.04975, section 3.2, "greedy expansion" of the speculation tree).

From the position of the matched string in a `SuffixTrie`, a node's probability is the
product along its path of each token's empirical probability (its count over the counts
of its siblings: how often, after that string, the corpus went on that way). `grow_tree`
takes nodes in order of that probability, a node's children becoming candidates once it is
taken, until `budget` nodes are taken or no candidate reaches `min_prob`; each node keeps
its `branch` most frequent children at most, no node deeper than `max_depth`. Its `score`,
the sum of the taken nodes' probabilities, is the number of tokens the corpus expects to
be accepted: the proposer keeps the better of two tries' trees by it.

The tree comes out breadth-first, siblings most frequent first, as `NodeTree` wants it.
Deterministic: ties go to the candidate found first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from infer.speculative.suffix_trie import Position, SuffixTrie


@dataclass(frozen=True, slots=True)
class SuffixTree:
    """A draft tree: node i's parent (-1: the root, the pending token) and token, breadth-first."""

    parents: tuple[int, ...]  # [n]
    tokens: tuple[int, ...]  # [n]
    score: float  # the taken nodes' probabilities, summed

    @property
    def is_path(self) -> bool:
        """Each node the only child of the one before: a chain."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


def grow_tree(trie: SuffixTrie, pos: Position, match_len: int, max_depth: int, budget: int, branch: int,
              min_prob: float) -> SuffixTree:
    """The draft after the string of length `match_len` at `pos` (module docstring)."""
    heap: list[tuple[float, int, int, int, int, Position, int]] = []
    found = 0  # candidates pushed so far (the tie-breaker)

    def offer(parent: int, at: Position, depth: int, prob: float) -> None:
        nonlocal found
        total, kids = trie.children(at, match_len + depth, branch)
        for rank, (token, count, kid) in enumerate(kids):
            p = prob * count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, found, parent, rank, token, kid, depth + 1))
                found += 1

    taken: list[tuple[int, int, int, int, float]] = []  # (parent, rank, token, depth, prob)
    if max_depth > 0:
        offer(-1, pos, 0, 1.0)
    while heap and len(taken) < budget:
        neg, _, parent, rank, token, kid, depth = heapq.heappop(heap)
        taken.append((parent, rank, token, depth, -neg))
        if depth < max_depth:
            offer(len(taken) - 1, kid, depth, -neg)
    return _breadth_first(taken)


def _breadth_first(taken: list[tuple[int, int, int, int, float]]) -> SuffixTree:
    """Taken nodes (parents taken before children) renumbered breadth-first: by depth, then
    the parent's new index, then sibling rank."""
    new: dict[int, int] = {-1: -1}
    order: list[int] = []
    for depth in sorted({d for _, _, _, d, _ in taken}):
        level = [i for i, node in enumerate(taken) if node[3] == depth]
        level.sort(key=lambda i: (new[taken[i][0]], taken[i][1]))
        for i in level:
            new[i] = len(order)
            order.append(i)
    return SuffixTree(tuple(new[taken[i][0]] for i in order), tuple(taken[i][2] for i in order),
                      sum(node[4] for node in taken))
