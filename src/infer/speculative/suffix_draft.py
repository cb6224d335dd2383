"""A suffix match's draft tree: the likeliest continuations, best first (SuffixDecoding,
arXiv 2411.04975, section 3.2: greedy expansion of the speculation tree).
"""

from __future__ import annotations

import heapq
import itertools
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
    """The draft after the string of length `match_len` at `pos`: nodes taken by probability (the
    product of count over siblings' counts along the path) until `budget` or `min_prob`, at most
    `branch` children a node and `max_depth` deep. Breadth-first; `score` sums the probabilities."""
    heap: list[tuple[float, int, int, int, int, Position, int]] = []
    taken: list[tuple[int, int, int, int, float]] = []  # (parent, rank, token, depth, prob)
    found = itertools.count()  # candidates in the order found (ties: the latest first)

    def offer(parent: int, at: Position, depth: int, prob: float) -> list[tuple[int, int, Position]]:
        """Push the children of `at` worth drafting; returns instead the lone one that keeps the whole
        probability (the best candidate at once), else []."""
        total, kids = trie.children(at, match_len + depth, branch)
        if len(kids) == 1 and kids[0][1] == total:
            return kids
        for rank, (token, count, kid) in reversed(list(enumerate(kids))):  # (the best found last)
            p = prob * count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, -next(found), parent, rank, token, kid, depth + 1))
        return []

    if max_depth > 0:
        lone = offer(-1, pos, 0, 1.0)
        if lone:
            heap.append((-1.0, 0, -1, 0, lone[0][0], lone[0][2], 1))
    while heap and len(taken) < budget:
        neg, _, parent, rank, token, kid, depth = heapq.heappop(heap)
        taken.append((parent, rank, token, depth, -neg))
        while depth < max_depth and len(taken) < budget:  # a run of lone children: no heap
            lone = offer(len(taken) - 1, kid, depth, -neg)
            if not lone:
                break
            token, _, kid = lone[0]
            depth += 1
            taken.append((len(taken) - 1, 0, token, depth, -neg))
    return _breadth_first(taken)


def _breadth_first(taken: list[tuple[int, int, int, int, float]]) -> SuffixTree:
    """Taken nodes renumbered breadth-first: by depth, then the parent's new index, then sibling rank."""
    score = sum(node[4] for node in taken)
    if all(node[0] == i - 1 for i, node in enumerate(taken)):  # a path: in order already
        return SuffixTree(tuple(range(-1, len(taken) - 1)), tuple(node[2] for node in taken), score)
    new: dict[int, int] = {-1: -1}
    order: list[int] = []
    for depth in sorted({d for _, _, _, d, _ in taken}):
        level = [i for i, node in enumerate(taken) if node[3] == depth]
        level.sort(key=lambda i: (new[taken[i][0]], taken[i][1]))
        for i in level:
            new[i] = len(order)
            order.append(i)
    return SuffixTree(tuple(new[taken[i][0]] for i in order), tuple(taken[i][2] for i in order), score)
