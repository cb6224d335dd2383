"""Dynamic trees over the Markov "language" of tree_harness.py: many rows drafted, selected
and verified at once, with the engine's own selection math (speculative/dynamic_select.py)
and the one tree verifier over a `TreeFrame` of per-row trees.

The target p and draft q are tables [depth + 1, V, V] (entry (t, prev): depth t + 1's token
after `prev`). A round drafts per row like `expand_dynamic`: the root's B children, then
per level the B best slots as the frontier, B children each; the N best slots of all
levels are the tree. `scorer` replaces the slot scores (the negative control ranks nodes by
their own path probability, as EAGLE-2 does for top-k drafts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from helpers.tree_harness import ROOT_TOKEN

from infer.sampling import SamplingParams
from infer.speculative.dynamic_select import NEG_INF, best_slots, draw_children, slot_scores
from infer.speculative.node_tree import TreeFrame
from infer.speculative.verifier import verify_tree_nodes

# scorer(base, tokens, drawn, parent_path, parent_score) -> (scores, paths), as `slot_scores`
Scorer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def own_path_scores(base: torch.Tensor, tokens: torch.Tensor, drawn: torch.Tensor, parent_path: torch.Tensor,
                    parent_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrong scorer: each node ranked by its OWN path probability (its draw decides its keep)."""
    _, paths = slot_scores(base, tokens, drawn, parent_path, parent_score)
    return torch.where(drawn & (parent_score[:, None] > NEG_INF), paths, NEG_INF), paths


def dynamic_round(p: torch.Tensor, q: torch.Tensor, rows: int, nodes: int, branch: int, depth: int,
                  gen: torch.Generator, sampled: bool = True, scorer: Scorer = slot_scores) -> torch.Tensor:
    """One verified dynamic tree per row -> packed [rows, depth + 2] (`verify_tree_nodes`)."""
    v = q.shape[-1]
    params = [SamplingParams(temperature=1.0 if sampled else 0.0)]
    front_tok = torch.full((rows, 1), ROOT_TOKEN)  # [R, F]
    front_path = torch.ones(rows, 1, dtype=torch.float64)
    front_score = torch.full((rows, 1), float("inf"), dtype=torch.float64)
    front_id = torch.full((rows, 1), -1)
    cand = {k: [] for k in ("tok", "score", "parent", "q", "depth")}
    offset = 0
    for d in range(depth):
        f = front_tok.shape[1]
        base_q = q[d, front_tok].reshape(-1, v)  # [R * F, V]
        u = torch.rand(rows * f, branch, generator=gen, dtype=torch.float64) if sampled else None
        kids, qrep, drawn, base = draw_children(base_q.log(), params * (rows * f), None, branch, u)
        scores, paths = scorer(base, kids, drawn, front_path.reshape(-1), front_score.reshape(-1))
        m = f * branch
        cand["tok"].append(kids.view(rows, m))
        cand["score"].append(scores.view(rows, m))
        cand["parent"].append(front_id.repeat_interleave(branch, dim=1))
        cand["q"].append(qrep.view(rows, m, v) if qrep is not None else torch.zeros(rows, m, v))
        cand["depth"].append(torch.full((rows, m), d + 1))
        pick, ok = best_slots(scores.view(rows, m), branch)
        front_tok = cand["tok"][-1].gather(1, pick)
        front_path = torch.where(ok, paths.view(rows, m).gather(1, pick), 0.0)
        front_score = torch.where(ok, scores.view(rows, m).gather(1, pick), NEG_INF)
        front_id = offset + pick
        offset += m
    tok, score, parent, qs, dep = (torch.cat(cand[k], dim=1) for k in ("tok", "score", "parent", "q", "depth"))
    sel, ok = best_slots(score, nodes)  # [R, N] storage order, invalid last
    sel_parent = parent.gather(1, sel)  # [R, N] candidate ids
    # a kept node's parent is kept and earlier (the order's guarantee): its block row is 1 + its place
    place = torch.searchsorted(sel.contiguous(), sel_parent.clamp(min=0).contiguous())  # [R, N]
    assert bool(((sel_parent < 0) | ~ok | (sel.gather(1, place.clamp(max=nodes - 1)) == sel_parent)).all())
    parent_row = torch.where(sel_parent < 0, 0, 1 + place)  # [R, N]
    # its rank among its kept siblings is its draw index (kept siblings: a prefix of the draws)
    rank = sel % branch  # [R, N] (every level starts at a multiple of B)
    children = torch.full((rows, nodes + 1, branch), -1)
    node = torch.arange(nodes).expand(rows, -1)
    flat = parent_row * branch + rank
    children.view(rows, -1).scatter_(1, torch.where(ok, flat, (nodes + 1) * branch - 1), torch.where(ok, node, -1))
    tokens = tok.gather(1, sel)  # [R, N]
    node_depth = dep.gather(1, sel)  # [R, N]
    target = torch.cat([p[0, ROOT_TOKEN].expand(rows, 1, v), p[node_depth.clamp(max=depth), tokens]], dim=1)
    draft_probs = qs.gather(1, sel[:, :, None].expand(-1, -1, v)) if sampled else None
    uniforms = torch.rand(rows, depth * branch + 1, generator=gen, dtype=torch.float64)
    frame = TreeFrame((branch,) * depth, children)
    packed, _ = verify_tree_nodes(frame, tokens, draft_probs, target, uniforms, ok)
    return packed
