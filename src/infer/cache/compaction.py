"""Moving an accepted tree path's keys and values into sequence order (tree speculation).

Accepted node i_d moves from n + 1 + i_d to n + d (its keys already rotated there); every
source is read before any destination is written. The caller truncates the slot afterwards.
docs/architecture.md, "Tree speculation".
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
