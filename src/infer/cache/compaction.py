"""Moving an accepted tree path's keys and values into sequence order (tree speculation).

A tree verification (or a draft model's tree expansion) stores block row r of a request at
storage position n + r: the pending token g at n, node i at n + 1 + i (`speculative.tree`).
After verification the accepted path (node indices in depth order, i_1 < i_2 < ...) must sit
at positions n + 1, n + 2, ...: node i_d moves from n + 1 + i_d to n + d. Its keys were
computed at rotary position n + d already, so moving the rows is all it takes.

Every source is read before any destination is written (one gather, then one scatter per
cache tensor, all layers and requests at once), so overlapping moves are safe. A node whose
index is d - 1 (any node of a chain "1,...,1"; in a wider tree only a first child at depth
1) is already in place and is not copied. The caller truncates the slot afterwards; rejected nodes' rows are simply past
the new end (prefix caching registers prompt blocks only, so it never sees them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.cache.protocol import CachePoolProtocol


@dataclass(frozen=True, slots=True)
class PathMove:
    """One request's accepted path: its slot, g's position n, and the accepted node indices."""

    slot: int
    base: int  # n: g's storage position
    nodes: tuple[int, ...]  # accepted node indices in depth order (node i_d stored at n + 1 + i_d)

    def __post_init__(self) -> None:
        if any(i < d for d, i in enumerate(self.nodes)):
            raise ValueError(f"node {self.nodes} is not an accepted path: the node at depth d has an index >= d - 1")


def path_rows(pool: CachePoolProtocol, moves: Sequence[PathMove]) -> tuple[list[int], list[int]]:
    """(source rows, destination rows) of the copies the moves need (nodes already in place skipped)."""
    src: list[int] = []
    dst: list[int] = []
    for move in moves:
        if not move.nodes or all(i == d for d, i in enumerate(move.nodes)):
            continue
        rows = pool.rows(move.slot, move.base, move.base + 2 + max(move.nodes)).tolist()  # positions n..
        for d, i in enumerate(move.nodes, start=1):
            if i + 1 != d:
                src.append(rows[1 + i])
                dst.append(rows[d])
    return src, dst


def move_paths(pool: CachePoolProtocol, moves: Sequence[PathMove]) -> int:
    """Copy each accepted node's K/V rows to its sequence position; returns rows copied."""
    src, dst = path_rows(pool, moves)
    if src:
        pool.move_rows(src, dst)
    return len(src)
