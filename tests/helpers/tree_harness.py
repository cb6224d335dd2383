"""Shared harness for the tree verification tests: a synthetic Markov "language" drafted as a tree.

The target p and the draft q depend on the depth and the previous token (the parent node's
token; ROOT_TOKEN precedes depth 1): p(x_t | x_{t-1}) = P[t - 1, x_{t-1}]. A round drafts a tree
over a `TreeShape` (children i.i.d. from q, or deterministic), the verifier emits L + 1 tokens,
and every emitted position t, given the tokens before it, must follow P[t - 1, x_{t-1}]
exactly. Rows are independent trials, generated and verified in chunks so that the
[rows, N, V] tensors stay small.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.sampling import sample_from_probs, sample_without_replacement
from infer.speculative.tree import TreeShape
from infer.speculative.verifier import verify_tree_nodes

ROOT_TOKEN = 0
CHUNK = 25_000
TV_BOUND = 0.01
# the most common prefixes of each position are checked (at most TOP_PREFIXES of them), if
# the expected sampling noise of their TV estimate is below NOISE
TOP_PREFIXES = 2
NOISE = 0.003

# verifier(shape, node_tokens, draft_probs, target_probs, uniforms, node_valid) -> (packed, nodes)
TreeVerifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def markov_tables(v: int, depth: int, seed: int, scale: float = 1.0, boost: float = 3.0,
                  favoured: int = 3, lead: float = 0.0, draft_noise: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [depth + 1, V, V]: entry (t, prev) scores depth t + 1's token
    after `prev`. `favoured` tokens per context get `boost`, the first of them `lead` more (a
    few likely tokens keep the TV estimate's noise low, and a leading one makes long prefixes
    common enough to check); the draft is the target plus noise (correlated, not equal)."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.rand(depth + 1, v, v, generator=gen).argsort(-1)  # [D+1, V, V]
    bonus = boost * (rank < favoured) + lead * (rank == 0)
    target = torch.randn(depth + 1, v, v, generator=gen) * scale + bonus
    draft = target + torch.randn(depth + 1, v, v, generator=gen) * scale * draft_noise
    return target, draft


def _ranked(q: torch.Tensor, width: int, duplicates: bool) -> torch.Tensor:
    """[D+1, V, width]: deterministic children per context, q's top tokens in order, or (with
    `duplicates`) each of the top tokens twice: t1, t1, t2, t2, ..."""
    order = q.argsort(dim=-1, descending=True, stable=True)  # [D+1, V, V]
    ranks = torch.arange(width) // 2 if duplicates else torch.arange(width)
    return order[..., ranks]


def _distinct_tree(shape: TreeShape, q: torch.Tensor, rows: int, gen: torch.Generator, valid: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Siblings drawn without replacement (`sample_without_replacement`, the draft model's
    way): tokens [R, N], each node's own q [R, N, V], valid [R, N] (siblings that found no
    mass left are absent, with their descendants)."""
    n, v = shape.num_nodes, q.shape[-1]
    parents = torch.tensor(shape.parents)  # [N]
    tokens, q_rows = torch.zeros(rows, n, dtype=torch.long), torch.zeros(rows, n, v)
    for d, width in enumerate(shape.branching):
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        prev = tokens[:, parents[lo:hi:width]] if d else torch.full((rows, 1), ROOT_TOKEN)  # [R, parents]
        u = torch.rand(prev.numel(), width, generator=gen, dtype=torch.float64)
        ids, dists, drawn = sample_without_replacement(q[d, prev].reshape(-1, v), u)
        tokens[:, lo:hi], q_rows[:, lo:hi] = ids.view(rows, -1), dists.view(rows, hi - lo, v)
        valid[:, lo:hi] &= drawn.view(rows, -1) & (valid[:, parents[lo:hi]] if d else True)
    return tokens, q_rows, valid


def draft_tree(shape: TreeShape, q: torch.Tensor, rows: int, gen: torch.Generator, mode: str,
               absent: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Draft `rows` trees: node tokens [R, N], their q [R, N, V] (None when deterministic) and
    node_valid [R, N]. mode "iid": siblings drawn i.i.d. from q(. | parent token); "distinct":
    drawn without replacement; "top": q's best distinct tokens; "dup": q's best tokens, each
    twice (deterministic modes give every row the same tree: an expanded view). `absent`:
    each node is dropped with this probability, and its descendants with it."""
    n, v = shape.num_nodes, q.shape[-1]
    parents = torch.tensor(shape.parents)  # [N]
    valid = torch.rand(rows, n, generator=gen) >= absent  # [R, N]
    if mode == "distinct":
        return _distinct_tree(shape, q, rows, gen, valid)
    ranked = None if mode == "iid" else _ranked(q, max(shape.branching), mode == "dup")
    r = rows if ranked is None else 1
    tokens = torch.zeros(r, n, dtype=torch.long)
    for d, width in enumerate(shape.branching):
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        up = parents[lo:hi]  # [n_d]
        prev = tokens[:, up] if d else torch.full((r, hi - lo), ROOT_TOKEN)  # [r, n_d]
        if d:
            valid[:, lo:hi] &= valid[:, up]
        if ranked is None:
            level = torch.empty_like(prev)  # [R, n_d]
            for a in range(v):  # the children of parents holding token a: i.i.d. from q[d, a]
                at = prev == a
                if count := int(at.sum()):
                    level[at] = torch.multinomial(q[d, a], count, replacement=True, generator=gen)
            tokens[:, lo:hi] = level
        else:
            tokens[:, lo:hi] = ranked[d, prev, torch.arange(hi - lo) % width]
    if ranked is not None:
        return tokens.expand(rows, n), None, valid
    depths = torch.tensor(shape.depths) - 1  # [N]: the table each node was drawn from
    prev_tokens = torch.where(parents >= 0, tokens[:, parents.clamp(min=0)], ROOT_TOKEN)  # [R, N]
    return tokens, q[depths, prev_tokens], valid


def target_rows(shape: TreeShape, p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[R, N+1, V]: p after g (depth 0, ROOT_TOKEN), then after each node (its depth, its
    token); rows that share one tree (an expanded `tokens`) share one expanded view."""
    rows = tokens.shape[0]
    depths = torch.tensor(shape.depths)  # [N]: node i's children are drawn from P[depth_i]
    if tokens.stride(0) == 0:  # every row holds the same tree
        one = torch.cat([p[0, ROOT_TOKEN][None], p[depths, tokens[0]]])  # [N+1, V]
        return one.expand(rows, -1, -1)
    root = p[0, ROOT_TOKEN].expand(rows, 1, -1)  # [R, 1, V]
    return torch.cat([root, p[depths, tokens]], dim=1)


def run_rounds(shape: TreeShape, p: torch.Tensor, q: torch.Tensor, rows: int, seed: int, mode: str = "iid",
               absent: float = 0.0, verifier: TreeVerifier = verify_tree_nodes
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """One verified tree per row -> (packed [rows, depth + 2], fractions of rows: "dup_root"
    (the root has duplicate children), "absent" (some node absent), "later_child" (a child
    other than the first accepted at some depth), "full" (the whole depth accepted))."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    stats = dict.fromkeys(("dup_root", "absent", "later_child", "full"), 0.0)
    starts, widths = torch.tensor(shape.level_starts[:-1]), torch.tensor(shape.branching)  # [D], [D]
    for start in range(0, rows, CHUNK):
        r = min(CHUNK, rows - start)
        tokens, q_rows, valid = draft_tree(shape, q, r, gen, mode, absent)
        uniforms = torch.rand(r, shape.num_uniforms, generator=gen, dtype=torch.float64)
        packed, nodes = verifier(shape, tokens, q_rows, target_rows(shape, p, tokens), uniforms, valid)
        out.append(packed)
        root = tokens[:, : shape.branching[0]]  # [R, b1]
        stats["dup_root"] += float((root[:, :, None] == root[:, None, :]).sum((1, 2)).gt(root.shape[1]).sum())
        stats["absent"] += float((~valid).any(1).sum())
        later = (nodes >= 0) & ((nodes - starts) % widths != 0)  # [R, D]: not its parent's first child
        stats["later_child"] += float(later.any(1).sum())
        stats["full"] += float((packed[:, shape.depth] == shape.depth).sum())
    return torch.cat(out), {k: v / rows for k, v in stats.items()}


def emitted(packed: torch.Tensor, depth: int) -> torch.Tensor:
    """[R, depth + 1]: the emitted tokens (accepted path then the final one), -1 after."""
    n_acc = packed[:, depth]  # [R]
    pos = torch.arange(depth + 1)[None, :]  # [1, D+1]
    path = torch.cat([packed[:, :depth], torch.zeros_like(packed[:, :1])], 1)  # [R, D+1]
    out = torch.where(pos < n_acc[:, None], path, -1)
    return torch.where(pos == n_acc[:, None], packed[:, depth + 1 : depth + 2], out)


def expected_noise(p: torch.Tensor, n: int) -> float:
    """E[TV] of the empirical distribution of n samples of p [V] (normal approximation)."""
    p = p.double()
    return 0.5 * float((2 * p * (1 - p) / (torch.pi * n)).sqrt().sum())


def conditional_tv(packed: torch.Tensor, p: torch.Tensor, depth: int,
                   noise: float = NOISE) -> tuple[float, list[int]]:
    """Largest TV between the emitted token at a position and p given the tokens before it,
    over the TOP_PREFIXES most common prefixes of each position that were seen often enough
    for the estimate's expected noise to be below `noise` -> (max TV, prefixes checked per
    position)."""
    v = p.shape[-1]
    tokens = emitted(packed, depth)  # [R, D+1]
    worst, checked = 0.0, []
    for t in range(depth + 1):
        rows = tokens[tokens[:, t] >= 0]  # [R_t, D+1]: rows that emitted position t
        code = torch.zeros(rows.shape[0], dtype=torch.long)
        for j in range(t):
            code = code * v + rows[:, j]
        prefixes, counts = torch.unique(code, return_counts=True)
        top = counts.argsort(descending=True)[:TOP_PREFIXES]
        done = 0
        for prefix, count in zip(prefixes[top].tolist(), counts[top].tolist()):
            prev = prefix % v if t else ROOT_TOKEN
            if expected_noise(p[t, prev], count) > noise:
                continue
            freq = torch.bincount(rows[code == prefix, t], minlength=v).double() / count
            worst = max(worst, 0.5 * float((freq - p[t, prev].double()).abs().sum()))
            done += 1
        checked.append(done)
    return worst, checked


def accept_first_child(shape: TreeShape, node_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, uniforms: torch.Tensor,
                       node_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A deliberately wrong verifier: keep the first child at every depth (the first node of
    each level), then a bonus token from p at the leaf."""
    firsts = list(shape.level_starts[:-1])  # the first-child path
    bonus = sample_from_probs(target_probs[:, 1 + firsts[-1]], uniforms[:, -1])
    b = node_tokens.shape[0]
    packed = torch.cat([node_tokens[:, firsts], torch.full((b, 1), shape.depth), bonus[:, None]], 1)
    return packed, torch.tensor(firsts).expand(b, -1)
