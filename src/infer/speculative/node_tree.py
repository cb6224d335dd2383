"""Trees given by their parents: dynamic trees and the verifier's per-row view of a batch of trees.

`DynamicShape` (`spec_tree="dynamic:N[:B]"`) is a round's setting; a row's tree is a `NodeTree`
(parents breadth-first, siblings in draw order). The verifier walks any batch of trees through a
`TreeFrame`; `frame_of_shape` is a static shape's. docs/speculation.md, "Trees given by their parents".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infer.sampling import is_strict_int
from infer.speculative.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, TreeShape

DYNAMIC_PREFIX = "dynamic:"
DEFAULT_BRANCH = 4  # EAGLE-2's top-k: children drawn per expanded node, and nodes expanded per level
_DYNAMIC_EXAMPLE = "'dynamic:16' (16 nodes verified a round) or 'dynamic:16:4' (and 4 children per expanded node)"


def is_dynamic(text: str | None) -> bool:
    """Whether a `spec_tree` value asks for dynamic trees ("dynamic:N[:B]")."""
    return isinstance(text, str) and text.strip().startswith(DYNAMIC_PREFIX)


def _offsets(widths: Sequence[int]) -> tuple[int, ...]:
    return tuple(sum(widths[:d]) for d in range(len(widths)))


class _Levels:
    """What a round's `widths` (children tried per node at each depth) fix for the verifier."""

    __slots__ = ()
    widths: tuple[int, ...]

    @property
    def depth(self) -> int:
        """The levels the round allows (the verifier's loop), not the deepest node's."""
        return len(self.widths)

    @property
    def num_uniforms(self) -> int:
        return sum(self.widths) + 1


@dataclass(frozen=True, slots=True)
class DynamicShape:
    """The dynamic-tree setting: up to `nodes` (N) verified nodes a round, at most `depth` (D) deep,
    each level expanding the `branch` (B) best nodes by B children. Rows share N, B and D, not trees."""

    nodes: int
    branch: int
    depth: int

    def __post_init__(self) -> None:
        for name, value, top in (("nodes", self.nodes, MAX_TREE_NODES), ("branch", self.branch, MAX_TREE_NODES),
                                 ("depth (spec_length)", self.depth, MAX_TREE_DEPTH)):
            if not is_strict_int(value) or not 1 <= value <= top:
                raise ValueError(f"a dynamic tree's {name} must be an integer in [1, {top}], got {value!r}")

    @classmethod
    def parse(cls, text: str, depth: int) -> DynamicShape:
        """"dynamic:N" or "dynamic:N:B" (B defaults to DEFAULT_BRANCH, capped at N); depth = K."""
        parts = [p.strip() for p in text.strip()[len(DYNAMIC_PREFIX):].split(":")] if is_dynamic(text) else []
        if not 1 <= len(parts) <= 2 or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"a dynamic tree is written {_DYNAMIC_EXAMPLE}, got {text!r}")
        nodes = int(parts[0])
        return cls(nodes, int(parts[1]) if len(parts) == 2 else min(DEFAULT_BRANCH, max(nodes, 1)), depth)

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.branch,) * self.depth

    @property
    def num_uniforms(self) -> int:
        """The verifier's uniforms a row: B per depth, and one for the final token."""
        return self.depth * self.branch + 1

    @property
    def is_chain(self) -> bool:
        return False

    def span(self, depth: int) -> int:
        """Positions past g a round of depth limit `depth` needs in either cache: N (the target's) or
        the fed levels plus one (the KV manager grows a proposer's pool one position short)."""
        return max(self.nodes, self.fed(depth) + 1)

    def fed(self, depth: int) -> int:
        """Nodes a round of depth limit `depth` feeds the draft: B a level, levels 1 .. depth - 1."""
        return max(0, depth - 1) * self.branch

    def __str__(self) -> str:
        return f"{DYNAMIC_PREFIX}{self.nodes}:{self.branch}"


@dataclass(frozen=True, slots=True)
class NodeTree(_Levels):
    """One row's tree: node i's parent is parents[i] (-1: the root), breadth-first, siblings in draw
    order; `widths` as the round's `DynamicShape`. Derived fields mirror `TreeShape`'s."""

    parents: tuple[int, ...]  # [N]
    widths: tuple[int, ...]  # [D]
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    root_children: tuple[int, ...] = field(init=False, repr=False, compare=False)
    paths: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    level_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)  # [D + 1]

    def __post_init__(self) -> None:
        depths: list[int] = []
        paths: list[tuple[int, ...]] = []
        children: list[list[int]] = [[] for _ in self.parents]
        roots: list[int] = []
        for i, parent in enumerate(self.parents):
            if not is_strict_int(parent) or not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent must be -1 (the root) or an earlier node, got {parent!r}")
            depths.append(1 if parent < 0 else depths[parent] + 1)
            paths.append((i,) if parent < 0 else (*paths[parent], i))
            (roots if parent < 0 else children[parent]).append(i)
            if i and depths[i] < depths[i - 1]:
                raise ValueError(f"nodes must be breadth-first: node {i} (depth {depths[i]}) follows a deeper node")
        if depths and max(depths) > len(self.widths):
            raise ValueError(f"a tree of {len(self.widths)} levels has a node at depth {max(depths)}")
        for node, kids in [(-1, roots), *enumerate(children)]:
            level = 0 if node < 0 else depths[node]
            if kids and len(kids) > self.widths[level]:
                raise ValueError(f"node {node} has {len(kids)} children, more than the {self.widths[level]} "
                                 f"allowed at depth {level + 1}")
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "root_children", tuple(roots))
        object.__setattr__(self, "paths", tuple(paths))
        object.__setattr__(self, "level_starts",
                           tuple(sum(d <= level for d in depths) for level in range(len(self.widths) + 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return False


@dataclass(frozen=True, eq=False)
class TreeFrame(_Levels):
    """The verifier's view of a batch of trees: each row's children of each block row."""

    widths: tuple[int, ...]  # [D]: children tried per node at depth d + 1
    children: torch.Tensor  # [B or 1, N+1, max(widths)] long: children of block row r (0 = g), -1 padded

    @property
    def num_nodes(self) -> int:
        return self.children.shape[1] - 1

    @property
    def uniform_offsets(self) -> tuple[int, ...]:
        return _offsets(self.widths)


def _children_table(rows: Sequence[Sequence[Sequence[int]]], n: int, c: int) -> torch.Tensor:
    """long [len(rows), n + 1, c] from per row, per block row, the children's node indices."""
    table = torch.full((len(rows), n + 1, c), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for r, kids in enumerate(row):
            table[b, r, :len(kids)] = torch.tensor(kids, dtype=torch.long)
    return table


@functools.lru_cache(maxsize=64)
def frame_of_shape(shape: TreeShape, device: torch.device) -> TreeFrame:
    """A static shape's frame, made once per device: every row the same children."""
    kids = [shape.root_children, *shape.children]
    return TreeFrame(shape.branching, _children_table([kids], shape.num_nodes, max(shape.branching)).to(device))


def as_frame(tree: TreeShape | TreeFrame, device: torch.device) -> TreeFrame:
    """The verifier's frame of a static shape, or a frame as it is."""
    return tree if isinstance(tree, TreeFrame) else frame_of_shape(tree, torch.device(device))


def round_widths(trees: Sequence[NodeTree]) -> tuple[int, ...]:
    """The fewest levels and children per level a frame of these trees needs (its uniform columns
    then move: `Verification` maps them back)."""
    widths: list[int] = []
    for tree in trees:
        for node, kids in [(-1, tree.root_children), *enumerate(tree.children)]:
            if kids:
                level = 0 if node < 0 else tree.depths[node]
                widths += [0] * (level + 1 - len(widths))
                widths[level] = max(widths[level], len(kids))
    return tuple(widths)


def frame_of_trees(trees: Sequence[NodeTree], n: int, widths: tuple[int, ...], device: torch.device) -> TreeFrame:
    """The frame of per-row trees of at most n nodes each, walked `widths` wide."""
    if any(t.num_nodes > n or not _fits(t, widths) for t in trees):
        raise ValueError(f"every tree needs at most {n} nodes and to fit widths {widths}")
    rows = [[t.root_children, *t.children] for t in trees]
    return TreeFrame(widths, _children_table(rows, n, max(widths)).to(device))


def _fits(tree: NodeTree, widths: tuple[int, ...]) -> bool:
    """No node deeper than len(widths), none with more children than widths at its depth."""
    if tree.num_nodes and max(tree.depths) > len(widths):
        return False
    return all(len(kids) <= widths[0 if node < 0 else tree.depths[node]]
               for node, kids in [(-1, tree.root_children), *enumerate(tree.children)] if kids)
