"""Drafting a static tree level by level (`expand_levels`): the loop a draft model and an EAGLE
head share, each with its own state and feed. docs/speculation.md, "A draft model".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from infer.sampling import SamplingParams, draw_uniforms
from infer.speculative.dynamic_select import draw_children
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import TreeShape
from infer.transfer import tensor_on, to_device

State = TypeVar("State")
# (depth d, rows still expanding, their places among the level before's rows, the new level's
# tokens [A'', P] on the device, the level before's states) -> the new level's states
Feed = Callable[[int, list[int], list[int], torch.Tensor, State], State]


def children(logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[list[int]] | None,
             width: int, uniforms: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`draw_children` flat: uniforms [M * width] -> (tokens [M * width] parent-major, q
    [M * width, V] float32, drawn [M * width] bool; q and drawn None when every row is greedy)."""
    tokens, q, drawn, _ = draw_children(logits, params, contexts, width,
                                        None if uniforms is None else uniforms.view(-1, width))
    if q is None:
        return tokens.reshape(-1), None, None
    return tokens.reshape(-1), q.reshape(-1, q.shape[-1]), drawn.reshape(-1)


def expand_levels(reqs: Sequence[DraftRequest], ks: Sequence[int], shape: TreeShape, device: torch.device,
                  root: State, logits_of: Callable[[State], torch.Tensor], feed: Feed
                  ) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
    """Levels 0 .. max(ks) - 1 of each row's tree. root: the states at g; logits_of(states) ->
    [A' * P, V] over target ids, parent-major -> (tokens [A][N] on the host, 0 below a row's k;
    q [A, N, V] on the device or None if all greedy; drawn [A][N]: 0 where no mass was left)."""
    batch, n_nodes = len(reqs), shape.num_nodes
    params = [r.sampling_params for r in reqs]
    base_contexts = [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None
    uniforms = (None if all(p.greedy for p in params)  # [A, N]
                else to_device(draw_uniforms([r.generator for r in reqs], n_nodes), device))
    tokens = torch.zeros((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    drawn = torch.ones((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    probs_out: torch.Tensor | None = None
    states, alive = root, list(range(batch))
    host: list[list[int]] = []  # tokens on the host, for penalty contexts only (from depth 1 on)
    for d, width in enumerate(shape.branching):  # parents at depth d, children at depth d + 1
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        rows = tensor_on(alive, device, torch.long)  # [A']
        contexts = None
        if base_contexts is not None:
            parents: Sequence[int | None] = range(shape.level_starts[d - 1], lo) if d else [None]
            contexts = [base_contexts[a] + ([] if p is None else [host[a][j] for j in shape.paths[p]])
                        for a in alive for p in parents]
        per_row = 1 if d == 0 else lo - shape.level_starts[d - 1]  # parents a row
        kids, q, ok = children(logits_of(states), [params[a] for a in alive for _ in range(per_row)], contexts,
                               width, None if uniforms is None else uniforms[rows, lo:hi].reshape(-1))
        tokens[rows, lo:hi] = kids.view(len(alive), hi - lo)
        if ok is not None:
            drawn[rows, lo:hi] = ok.view(len(alive), hi - lo).long()
        if q is not None:
            if probs_out is None:
                probs_out = torch.zeros((batch, n_nodes, q.shape[-1]), dtype=q.dtype, device=device)
            probs_out[rows, lo:hi] = q.view(len(alive), hi - lo, -1)
        keep = [j for j, a in enumerate(alive) if ks[a] > d + 1]
        if not keep:
            break
        alive = [alive[j] for j in keep]
        if base_contexts is not None:
            host = tokens.tolist()  # (a sync per level, only when a penalty reads the contexts)
        states = feed(d, alive, keep, tokens[tensor_on(alive, device, torch.long), lo:hi], states)
    out = torch.cat([tokens, drawn], dim=1).tolist()  # (the one sync of a round without penalties)
    return [row[:n_nodes] for row in out], probs_out, [row[n_nodes:] for row in out]
