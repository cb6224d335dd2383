"""Static token trees for tree speculation: the shape, its masks and positions, and a draft.

`TreeShape` ("3,2,1,1": `branching[d]` children for every node at depth d) numbers nodes breadth-first;
`chain_shape(k)` is "1,...,1". `tree_attention_mask`, `position_offsets` and `TreeChunk` lay out the verification
block [g, nodes]. A `Draft` is a token per node (absent nodes flagged) with its q; `fill_tree` and `cut_depth` build
and cut drafts. SpecInfer's tree attention (Stratos, section 2.1): docs/speculation.md, "Static trees"."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from infer.cache.forward_batch import RowTree
from infer.sampling import is_strict_int

MAX_TREE_DEPTH = 32
MAX_TREE_NODES = 128

_EXAMPLE = "'3,2,1,1' (3 candidates, two children each, then chains)"


class DraftTree(Protocol):
    """A `Draft`'s tree: a static `TreeShape` or one row's `NodeTree`; nodes breadth-first,
    `widths[d]` the most children a node at depth d has."""

    @property
    def parents(self) -> tuple[int, ...]: ...

    @property
    def depths(self) -> tuple[int, ...]: ...

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def level_starts(self) -> tuple[int, ...]: ...

    @property
    def widths(self) -> tuple[int, ...]: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def depth(self) -> int: ...

    @property
    def is_chain(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class TreeShape:
    """A static speculation tree: `branching[d]` children for every node at depth d.
    `TreeShape((3, 2, 1, 1))` or `TreeShape.parse("3,2,1,1")`; derived fields index nodes
    breadth-first; equality and hashing use `branching` only."""

    branching: tuple[int, ...]
    parents: tuple[int, ...] = field(init=False, repr=False, compare=False)  # [N]; -1 = root's child
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)  # [N], 1-based
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)  # [N] lists
    root_children: tuple[int, ...] = field(init=False, repr=False, compare=False)
    paths: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    # paths[i]: the nodes from depth 1 down to node i (its ancestors then i itself)
    level_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # [depth + 1]: level_starts[d] is the first node of depth d + 1; level_starts[depth] = N
    uniform_offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # [depth]: the verifier's uniform for the c-th child tried at depth d + 1 is column uniform_offsets[d] + c
    is_chain: bool = field(init=False, repr=False, compare=False)
    # every node has one child: "1,1,...,1" (verified causally, no tree mask)

    def __post_init__(self) -> None:
        branching = self._validated(self.branching)
        object.__setattr__(self, "branching", branching)
        parents: list[int] = []
        depths: list[int] = []
        starts = [0]
        previous = [-1]  # the nodes of the level above (the root first)
        for d, b in enumerate(branching, start=1):
            level = []
            for parent in previous:
                for _ in range(b):
                    level.append(len(parents))
                    parents.append(parent)
                    depths.append(d)
            starts.append(len(parents))
            previous = level
        n = len(parents)
        children: list[list[int]] = [[] for _ in range(n)]
        for node, parent in enumerate(parents):
            if parent >= 0:
                children[parent].append(node)
        paths: list[tuple[int, ...]] = []
        for node, parent in enumerate(parents):
            paths.append((*paths[parent], node) if parent >= 0 else (node,))
        offsets = [sum(branching[:d]) for d in range(len(branching))]
        object.__setattr__(self, "parents", tuple(parents))
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "root_children", tuple(range(branching[0])))
        object.__setattr__(self, "paths", tuple(paths))
        object.__setattr__(self, "level_starts", tuple(starts))
        object.__setattr__(self, "uniform_offsets", tuple(offsets))
        object.__setattr__(self, "is_chain", all(b == 1 for b in branching))

    @staticmethod
    def _validated(branching: object) -> tuple[int, ...]:
        if not isinstance(branching, (tuple, list)):
            raise ValueError(f"tree shape must be a sequence of child counts per depth, like {_EXAMPLE}, "
                             f"got {branching!r}")
        if not 1 <= len(branching) <= MAX_TREE_DEPTH:
            raise ValueError(f"tree shape must have 1 to {MAX_TREE_DEPTH} levels (its depth), got "
                             f"{len(branching)}: give one child count per depth, like {_EXAMPLE}")
        nodes, width = 0, 1
        for d, b in enumerate(branching, start=1):
            if not is_strict_int(b) or b < 1:
                raise ValueError(f"tree shape entries are children per node and must be integers >= 1, "
                                 f"got {b!r} at depth {d} in {tuple(branching)!r}")
            width *= b
            nodes += width
            if nodes > MAX_TREE_NODES:
                raise ValueError(f"tree shape {tuple(branching)!r} has more than {MAX_TREE_NODES} nodes "
                                 f"(already {nodes} at depth {d}): use fewer children per node or fewer levels")
        return tuple(branching)

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """A shape from comma-separated child counts, e.g. "3,2,1,1" (spaces are ignored)."""
        if not isinstance(text, str):
            raise ValueError(f"tree shape text must be a string like {_EXAMPLE}, got {text!r}")
        parts = [part.strip() for part in text.split(",")]
        if not all(part.isascii() and part.isdigit() for part in parts):
            raise ValueError(f"tree shape must be comma-separated integers >= 1, like {_EXAMPLE}, got {text!r}")
        return cls(tuple(int(part) for part in parts))

    @property
    def num_nodes(self) -> int:
        """N: the tree's nodes (the root, i.e. the pending token, not counted)."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """The number of levels: the most draft tokens one verification can accept."""
        return len(self.branching)

    @property
    def num_uniforms(self) -> int:
        """U = sum(branching) + 1: uniforms one row needs, a column per (depth, child index) and
        the last for the final token, so a seeded row's tokens never depend on its batch."""
        return sum(self.branching) + 1

    @property
    def widths(self) -> tuple[int, ...]:
        """Children per node at each depth (the verifier's tries; a dynamic tree's are per level too)."""
        return self.branching

    def span(self, depth: int) -> int:
        """Positions past g a round of depth limit `depth` writes: the nodes of depths <= depth."""
        return self.level_starts[depth]

    def fed(self, depth: int) -> int:
        """Nodes a draft model is fed in a round of depth limit `depth` >= 1 (depths 1 .. depth - 1)."""
        return self.level_starts[depth - 1]

    def __str__(self) -> str:
        return ",".join(str(b) for b in self.branching)


def chain_shape(k: int) -> TreeShape:
    """The chain of k drafts as a tree: "1,1,...,1" (k >= 1), one shared shape per length."""
    if not is_strict_int(k) or not 1 <= k <= MAX_TREE_DEPTH:
        raise ValueError(f"a chain needs an integer length in [1, {MAX_TREE_DEPTH}], got {k!r}")
    return _chain(k)


@functools.lru_cache(maxsize=None)
def _chain(k: int) -> TreeShape:
    return TreeShape((1,) * k)


def ancestor_mask(shape: TreeShape, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [N, N]: entry (i, j) is True iff node j is node i or one of its ancestors."""
    n = shape.num_nodes
    rows = [[False] * n for _ in range(n)]
    for i, path in enumerate(shape.paths):
        for j in path:
            rows[i][j] = True
    return torch.tensor(rows, dtype=torch.bool, device=device)


def tree_attention_mask(shape: TreeShape, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [N+1, N+1] over the block [g, nodes]: g sees itself; node i sees g, its ancestors
    and itself. (Every block row also sees the whole cached context; that part is not here.)"""
    n = shape.num_nodes
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    mask[:, 0] = True
    mask[1:, 1:] = ancestor_mask(shape, device)
    return mask


def position_offsets(shape: TreeShape, device: torch.device | str | None = None) -> torch.Tensor:
    """long [N+1]: block row r sits at position n + offsets[r] (g at n, a depth-d node at n + d)."""
    return torch.tensor((0, *shape.depths), dtype=torch.long, device=device)


@dataclass(frozen=True, slots=True)
class TreeChunk:
    """Rows [first_row, first_row + width) of a tree's block [g, nodes] fed as one chunk: the
    whole block (`verification`) or one depth's nodes (`level`). Block row r is stored at
    base + r (g at base = n) and rotated at base + [0, *depths][r]; `mask` is its visibility."""

    shape: TreeShape
    first_row: int
    width: int

    def __post_init__(self) -> None:
        rows = self.shape.num_nodes + 1
        if not (is_strict_int(self.first_row) and is_strict_int(self.width) and self.width >= 1
                and 0 <= self.first_row and self.first_row + self.width <= rows):
            raise ValueError(f"a chunk of tree {self.shape} must lie within its {rows} block rows, got rows "
                             f"{self.first_row!r}..+{self.width!r}")

    @classmethod
    def verification(cls, shape: TreeShape) -> TreeChunk:
        """The whole block [g, node_0..node_{N-1}] (the target's verification forward)."""
        return cls(shape, 0, shape.num_nodes + 1)

    @classmethod
    def level(cls, shape: TreeShape, depth: int) -> TreeChunk:
        """The nodes of one depth (1..shape.depth), in node order."""
        if not is_strict_int(depth) or not 1 <= depth <= shape.depth:
            raise ValueError(f"depth must be in 1..{shape.depth} for tree {shape}, got {depth!r}")
        start, end = shape.level_starts[depth - 1], shape.level_starts[depth]
        return cls(shape, 1 + start, end - start)

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [width, N+1]: which block rows each of the chunk's rows may see."""
        return tree_attention_mask(self.shape, device)[self.first_row:self.first_row + self.width]

    def rotary_offsets(self, device: torch.device | str | None = None) -> torch.Tensor:
        """long [width]: rotary position of each chunk row minus the chunk's storage start."""
        rows = position_offsets(self.shape)[self.first_row:self.first_row + self.width]
        return (rows - self.first_row).to(device)

    def rule(self, rows: int | None = None) -> RowTree:
        """The chunk's first `rows` rows (default all) as a flat batch row's tree rule."""
        return chunk_rule(self.mask(), position_offsets(self.shape)[self.first_row:self.first_row + self.width],
                          self.first_row, rows)


def chunk_rule(mask: torch.Tensor, depths: torch.Tensor, first_row: int, rows: int | None = None) -> RowTree:
    """A tree chunk as a row's rule: mask bool [T, W] (the block rows each of its rows sees),
    depths [T] (each row's rotary offset from the block's first position), first_row (where
    the chunk starts in the block); its first `rows` rows."""
    rows = mask.shape[0] if rows is None else rows
    weights = [1 << c for c in range(mask.shape[1])]
    bits = [sum(w for w, seen in zip(weights, row, strict=True) if seen) for row in mask[:rows].tolist()]
    return RowTree(bits, depths[:rows].tolist(), -first_row, mask.shape[1])


class RoundTokens:
    """A round's drafted tokens [A, S] left on the device (an EAGLE head's fused round), row j
    a draft's first nodes; read to the host once, the first time anything asks (`host`)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # [A, S] long, ids >= 0
        self._host: list[list[int]] | None = None

    def host(self) -> list[list[int]]:
        """The tokens on the host (one sync, the first time)."""
        if self._host is None:
            self._host = self.tokens.tolist()
        return self._host


@dataclass(frozen=True, slots=True)
class Draft:
    """One request's proposal over a `TreeShape` (or its own dynamic `NodeTree`): a token per node.

    Absent nodes (valid False, token 0) are never accepted; a present node's parent is present.
    `probs` is the q each node was drawn from, None for deterministic (one-hot) proposals. A
    chain drafted on the device (`on_device`) reaches the host only when `token_ids` is read."""

    shape: DraftTree
    host_ids: tuple[int, ...] | None  # [N]; None while the tokens are on the device alone (`on_device`)
    valid: tuple[bool, ...]  # [N]
    # [M, V] for the first M <= N nodes (every present node among them), or None
    probs: torch.Tensor | None = field(default=None, compare=False)
    # a chain's tokens on the device: row `[1]` of the round's `[0]`, its first num_proposed nodes
    on_device: tuple[RoundTokens, int] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = self.shape.num_nodes
        if self.host_ids is None and self.on_device is None:
            raise ValueError("a draft needs its token ids on the host (host_ids) or on the device (on_device)")
        if len(self.valid) != n or (self.host_ids is not None and len(self.host_ids) != n):
            raise ValueError(f"a draft over tree {self.shape} needs {n} token ids and {n} validity flags, "
                             f"got {None if self.host_ids is None else len(self.host_ids)} and {len(self.valid)}")
        valid, parents = self.valid, self.shape.parents
        # (a device chain's tokens are its round's ids; `chain_on_device` made its flags)
        tokens = self.host_ids if self.host_ids is not None else ()
        for node, token in enumerate(tokens):  # (every proposal passes here: kept lean)
            ok = valid[node]
            if type(ok) is not bool:
                raise ValueError(f"valid must hold True/False, got {ok!r} at node {node}")
            if type(token) is not int or token < 0 or (token and not ok):
                raise ValueError(f"node {node}: token ids must be integers >= 0, and 0 at absent nodes; "
                                 f"got {token!r} (present: {ok})")
            if ok and parents[node] >= 0 and not valid[parents[node]]:
                raise ValueError(f"node {node} is present but its parent {parents[node]} is absent")
        if self.probs is not None and (self.probs.dim() != 2 or not self.rows_used - 1 <= self.probs.shape[0] <= n):
            raise ValueError(f"probs must be None or [M, vocab] for the first M nodes, M covering every present "
                             f"node and at most {n}, got shape {tuple(self.probs.shape)}")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """[N] the node tokens on the host (a device draft's through `RoundTokens.host`'s one read)."""
        if self.host_ids is not None:
            return self.host_ids
        assert self.on_device is not None
        round_tokens, row = self.on_device
        k = self.num_proposed
        return tuple(round_tokens.host()[row][:k]) + (0,) * (self.shape.num_nodes - k)

    @property
    def num_proposed(self) -> int:
        """How many nodes are present."""
        return sum(self.valid)

    @property
    def depth(self) -> int:
        """The deepest present node's depth (0: nothing proposed)."""
        if self.shape.is_chain:  # (a chain's present nodes are its first ones)
            return self.num_proposed
        return max((d for d, ok in zip(self.shape.depths, self.valid, strict=True) if ok), default=0)

    @property
    def rows_used(self) -> int:
        """Block rows up to the last present node: 1 (g) + its index + 1; 1 when none."""
        last = max((i for i, ok in enumerate(self.valid) if ok), default=-1)
        return 2 + last

    @classmethod
    def chain(cls, shape: TreeShape, token_ids: Sequence[int], probs: torch.Tensor | None = None) -> Draft:
        """`token_ids` on the first nodes of chain `shape`, the rest absent; probs [k, V] or None."""
        n, k = shape.num_nodes, len(token_ids)
        if not shape.is_chain or k > n:
            raise ValueError(f"a chain draft of {k} tokens needs a chain shape of at least {k} nodes, got {shape}")
        return cls(shape, tuple(token_ids) + (0,) * (n - k), (True,) * k + (False,) * (n - k), probs)

    @classmethod
    def chain_on_device(cls, shape: TreeShape, tokens: RoundTokens, row: int, k: int,
                        probs: torch.Tensor | None = None) -> Draft:
        """A chain draft of k tokens left on the device: row `row` of the round's `tokens`."""
        n = shape.num_nodes
        if not shape.is_chain or not 0 <= k <= min(n, tokens.tokens.shape[1]):
            raise ValueError(f"a chain draft of {k} tokens needs a chain shape of at least {k} nodes and a round "
                             f"of as many steps, got {shape} and {tokens.tokens.shape[1]} steps")
        return cls(shape, None, (True,) * k + (False,) * (n - k), probs, (tokens, row))

    @classmethod
    def empty(cls, shape: TreeShape) -> Draft:
        """No proposal at all: every node absent (verification is then a plain decode step)."""
        n = shape.num_nodes
        return cls(shape, (0,) * n, (False,) * n)


def cut_depth(draft: Draft, depth: int) -> Draft:
    """The draft with every node deeper than `depth` absent (0 <= depth; probs kept)."""
    if not is_strict_int(depth) or depth < 0:
        raise ValueError(f"depth must be an integer >= 0, got {depth!r}")
    if depth >= draft.shape.depth:
        return draft
    keep = draft.shape.level_starts[depth]  # nodes of depth <= `depth` come first (breadth-first)
    n = draft.shape.num_nodes
    tokens = draft.token_ids[:keep] + (0,) * (n - keep)
    valid = draft.valid[:keep] + (False,) * (n - keep)
    return Draft(draft.shape, tokens, valid, draft.probs)


def stack_drafts(drafts: Sequence[Draft], device: torch.device | str | None = None, width: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts as verifier inputs: (node_tokens [B, N] long, node_valid [B, N] bool); one shared
    shape, or (dynamic trees) rows padded with absent nodes to `width`."""
    if not drafts:
        raise ValueError("stack_drafts needs at least one draft (the tree shape comes from them)")
    if width is None and any(d.shape != drafts[0].shape for d in drafts):
        raise ValueError(f"drafts must share one tree shape, got {sorted({str(d.shape) for d in drafts})}")
    n = drafts[0].shape.num_nodes if width is None else width
    if any(d.shape.num_nodes > n for d in drafts):
        raise ValueError(f"drafts of more than {n} nodes cannot be stacked {n} wide")
    tokens = torch.tensor([(*d.token_ids, *(0,) * (n - len(d.token_ids))) for d in drafts], dtype=torch.long,
                          device=device)
    valid = torch.tensor([(*d.valid, *(False,) * (n - len(d.valid))) for d in drafts], dtype=torch.bool,
                         device=device)
    return tokens, valid


class BranchSource(Protocol):
    """Anything that ranks distinct next tokens for a context (the n-gram tables)."""

    def top_continuations(self, context: Sequence[int], n: int) -> list[int]: ...


def fill_tree(source: BranchSource, context: Sequence[int], shape: TreeShape) -> Draft:
    """A deterministic draft over `shape`: a node's children are the source's best distinct next
    tokens after `context` + the node's path, in rank order; unfilled children and their
    descendants are absent."""
    n = shape.num_nodes
    tokens, valid = [0] * n, [False] * n
    base = list(context)
    for node in (-1, *range(n)):  # breadth-first: a parent is filled before its children
        if node >= 0 and not (valid[node] and shape.children[node]):
            continue
        kids = shape.children[node] if node >= 0 else shape.root_children
        path = [tokens[j] for j in shape.paths[node]] if node >= 0 else []
        for kid, token in zip(kids, source.top_continuations(base + path, len(kids))):
            tokens[kid], valid[kid] = token, True
    return Draft(shape, tuple(tokens), tuple(valid))
