"""A draft model's dynamic tree round (`expand_dynamic`): one batched draft step a level over
each row's frontier of B best slots; the N best of all levels are the row's tree.
Storage and selection: docs/speculation.md, "Dynamic trees".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.cache.forward_batch import DeviceIds, Row, plan_batch
from infer.sampling import draw_uniforms
from infer.speculative.dynamic_select import NEG_INF, best_slots, draw_children, kept_tree, slot_scores
from infer.speculative.forward import ForwardFn
from infer.speculative.node_tree import DynamicShape, NodeTree
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import chunk_rule
from infer.transfer import tensor_on, to_device


@dataclass(frozen=True)
class DynamicRow:
    """One row's result: its tree, tokens and q per node, and where its fed nodes sit."""

    tree: NodeTree
    tokens: tuple[int, ...]  # [m]
    probs: torch.Tensor | None  # [m, V] on the device (None: a greedy row, one-hot q)
    storage: tuple[int, ...]  # [m]: the node's index in the draft's block (row - 1), -1 if never fed


@dataclass
class _Level:
    """One level's candidates for A rows (M = parents x B slots, parent-major)."""

    tokens: torch.Tensor  # [A, M] long
    scores: torch.Tensor  # [A, M] float64, -inf: none
    paths: torch.Tensor  # [A, M] float64
    parents: torch.Tensor  # [A, M] long: parent's global candidate index, -1 the root
    fed_row: torch.Tensor  # [A, M] long: block row once fed into the draft, -1 never
    probs: torch.Tensor | None  # [A, M, V]


def draft_uniform_count(shape: DynamicShape) -> int:
    return shape.branch + (shape.depth - 1) * shape.branch ** 2


@dataclass
class _Frontier:
    """The nodes a level expands, per alive row (A') and place (F): the root at first."""

    alive: list[int]  # [A'] batch rows
    path: torch.Tensor  # [A', F] float64 path probabilities
    score: torch.Tensor  # [A', F] float64 slot scores (-inf: no node)
    ids: torch.Tensor  # [A', F] long global candidate indices (-1: the root)
    mask: torch.Tensor  # [A', F, W] bool: the draft's block rows each sees
    contexts: list[list[list[int]]] | None  # [A'][F] token contexts (penalties only)

    @classmethod
    def root(cls, a_rows: int, width: int, contexts: list[list[int]] | None, device: torch.device) -> _Frontier:
        mask = torch.zeros((a_rows, 1, width), dtype=torch.bool, device=device)
        mask[:, :, 0] = True
        return cls(list(range(a_rows)), torch.ones((a_rows, 1), dtype=torch.float64, device=device),
                   torch.full((a_rows, 1), float("inf"), dtype=torch.float64, device=device),
                   torch.full((a_rows, 1), -1, dtype=torch.long, device=device), mask,
                   None if contexts is None else [[c] for c in contexts])


def expand_dynamic(forward: ForwardFn, reqs: Sequence[DraftRequest], slots: Sequence[int], root_logits: torch.Tensor,
                   ks: Sequence[int], shape: DynamicShape) -> list[DynamicRow]:
    """The round's trees: root_logits [A, V] after g; ks[a] in 1..D. A row draws
    `draft_uniform_count` uniforms whatever its k."""
    device, a_rows, b = root_logits.device, len(reqs), shape.branch
    params = [r.sampling_params for r in reqs]
    uniforms = None if all(p.greedy for p in params) else to_device(
        draw_uniforms([r.generator for r in reqs], draft_uniform_count(shape)), device)  # [A, U]
    contexts = [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None
    front = _Frontier.root(a_rows, 1 + shape.fed(shape.depth), contexts, device)
    levels: list[_Level] = []
    logits = root_logits[:, None]  # [A', F, V] after the frontier's nodes
    offset = 0  # global index of the level's first candidate
    for d in range(shape.depth):
        f, n_alive = logits.shape[1], len(front.alive)
        rows = tensor_on(front.alive, device, torch.long)  # [A']
        lo = 0 if d == 0 else b + (d - 1) * b * b
        u = None if uniforms is None else uniforms[rows, lo:lo + f * b].reshape(-1, b)
        ctx = None if front.contexts is None else [c for row in front.contexts for c in row]
        kids, q, drawn, base = draw_children(logits.reshape(-1, logits.shape[-1]),
                                             [params[a] for a in front.alive for _ in range(f)], ctx, b, u)
        scores, paths = slot_scores(base, kids, drawn, front.path.reshape(-1), front.score.reshape(-1))
        # (every level keeps q when any row samples: the levels are concatenated column for column)
        level = _empty_level(a_rows, f * b, None if uniforms is None else logits.shape[-1], device)
        level.tokens[rows] = kids.view(n_alive, f * b)
        level.scores[rows] = scores.view(n_alive, f * b)
        level.paths[rows] = paths.view(n_alive, f * b)
        level.parents[rows] = front.ids.repeat_interleave(b, dim=1)
        if q is not None and level.probs is not None:
            level.probs[rows] = q.view(n_alive, f * b, -1)
        levels.append(level)
        keep = [j for j, a in enumerate(front.alive) if ks[a] > d + 1]
        if not keep:
            break
        first_row = 1 + d * b  # the new frontier's first row in the draft's block
        front, ids = _advance(front, level, keep, b, first_row, offset)
        depths = torch.full((b,), d + 1, dtype=torch.long)  # rotary n + d + 1
        rows_of = [Row(slots[a], reqs[a].num_computed_tokens + first_row, [0] * b, logits=b,
                       tree=chunk_rule(mask, depths, first_row)) for a, mask in zip(front.alive, front.mask.cpu(),
                                                                                    strict=True)]
        logits = forward.run(plan_batch(rows_of), DeviceIds(tuple(range(ids.numel())), ids.reshape(-1)))
        logits = logits.view(len(front.alive), b, -1)  # [A'', B, V]
        offset += f * b
    return _rows(levels, shape)


def _advance(front: _Frontier, level: _Level, keep: list[int], b: int, first_row: int,
             offset: int) -> tuple[_Frontier, torch.Tensor]:
    """The next frontier: the level's B best slots of the rows in `keep` (places in `front.alive`),
    marked fed at block rows first_row + f -> (it, tokens [A'', B])."""
    device = level.tokens.device
    alive = [front.alive[j] for j in keep]
    rows, sub = tensor_on(alive, device, torch.long)[:, None], tensor_on(keep, device, torch.long)[:, None]
    pick, ok = best_slots(level.scores[rows[:, 0]], b)  # [A'', B] level-local, storage order
    places = torch.arange(pick.shape[1], device=device)  # [B]
    level.fed_row[rows, pick] = first_row + places[None, :]
    parent_place = pick // b  # [A'', B]: the parent's place in the old frontier
    mask = front.mask[sub, parent_place]  # [A'', B, W]: the parent's rows ...
    mask[:, places, first_row + places] = True  # ... and its own
    ids = level.tokens[rows, pick]  # [A'', B]
    contexts = None
    if front.contexts is not None:
        host_ids, host_parent = ids.tolist(), parent_place.tolist()
        contexts = [[front.contexts[j][p] + [t] for p, t in zip(host_parent[i], host_ids[i], strict=True)]
                    for i, j in enumerate(keep)]
    return _Frontier(alive, torch.where(ok, level.paths[rows, pick], 0.0),
                     torch.where(ok, level.scores[rows, pick], NEG_INF), offset + pick, mask, contexts), ids


def _empty_level(a_rows: int, m: int, vocab: int | None, device: torch.device) -> _Level:
    return _Level(tokens=torch.zeros((a_rows, m), dtype=torch.long, device=device),
                  scores=torch.full((a_rows, m), NEG_INF, dtype=torch.float64, device=device),
                  paths=torch.zeros((a_rows, m), dtype=torch.float64, device=device),
                  parents=torch.full((a_rows, m), -1, dtype=torch.long, device=device),
                  fed_row=torch.full((a_rows, m), -1, dtype=torch.long, device=device),
                  probs=None if vocab is None else torch.zeros((a_rows, m, vocab), dtype=torch.float32, device=device))


def _rows(levels: Sequence[_Level], shape: DynamicShape) -> list[DynamicRow]:
    """The N best slots of every level per row, as trees (one host sync)."""
    scores = torch.cat([lv.scores for lv in levels], dim=1)  # [A, M_total]
    pick, ok = best_slots(scores, shape.nodes)  # [A, N]
    tokens = torch.cat([lv.tokens for lv in levels], dim=1)
    parents = torch.cat([lv.parents for lv in levels], dim=1)
    fed = torch.cat([lv.fed_row for lv in levels], dim=1)
    host = torch.cat([pick, ok.long(), tokens.gather(1, pick), fed.gather(1, pick)], dim=1).tolist()
    host_parents = parents.tolist()
    probs = None if levels[0].probs is None else torch.cat([lv.probs for lv in levels if lv.probs is not None],
                                                           dim=1)  # [A, M_total, V]
    n = pick.shape[1]
    out = []
    for a, row in enumerate(host):
        m = sum(row[n:2 * n])
        selected = row[:m]
        tree = NodeTree(tuple(kept_tree(selected, host_parents[a])), shape.widths)
        row_probs = None if probs is None else probs[a, pick[a, :m]]
        out.append(DynamicRow(tree, tuple(row[2 * n:2 * n + m]), row_probs,
                              tuple(r - 1 if r >= 0 else -1 for r in row[3 * n:3 * n + m])))
    return out
