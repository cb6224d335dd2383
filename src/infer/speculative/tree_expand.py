"""Drafting a static tree level by level: the loop a draft model and an EAGLE head share.

`expand_levels` gives level d's parents (the root for d = 0) `branching[d]` children each
from their draft states (`children`: greedy rows the top-b tokens in rank order, sampled
rows b distinct draws without replacement from q, each with its renormalised q; penalised
rows see the context plus the path), then feeds the new level to the drafter for the rows
that go deeper. What a state is and how a level is fed is the drafter's (a draft model's
logits and flat pass; an EAGLE head's features, `eagle_tree.py`). A row draws its N uniforms
once a round from its own generator. Why this keeps the verifier exact:
docs/speculation.md, "A draft model".
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
# (depth d of the level just chosen, rows still expanding (batch indices), their places among
# the rows of the level before, the new level's tokens [A'', P] on the device, the states of
# the level before) -> the new level's states
Feed = Callable[[int, list[int], list[int], torch.Tensor, State], State]


def children(logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[list[int]] | None,
             width: int, uniforms: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`width` children per parent, flat: logits [M, V] (one row per parent), the parents'
    params and contexts (None: no penalties), uniforms [M * width] (None: every row greedy)
    -> (tokens [M * width] parent-major, q [M * width, V] float32 or None, drawn [M * width]
    bool or None; both None when every row is greedy): `draw_children`'s, flat."""
    tokens, q, drawn, _ = draw_children(logits, params, contexts, width,
                                        None if uniforms is None else uniforms.view(-1, width))
    if q is None:
        return tokens.reshape(-1), None, None
    return tokens.reshape(-1), q.reshape(-1, q.shape[-1]), drawn.reshape(-1)


def expand_levels(reqs: Sequence[DraftRequest], ks: Sequence[int], shape: TreeShape, device: torch.device,
                  root: State, logits_of: Callable[[State], torch.Tensor], feed: Feed
                  ) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
    """Levels 0 .. max(ks) - 1 of each row's tree. root: the states at g (one a row);
    logits_of(states) -> [A' * P, V] logits over target ids, parent-major; feed: above.
    Returns (tokens [A][N] on the host, q [A, N, V] on the device or None when every row is
    greedy, drawn [A][N] on the host: 0 where a sibling found no mass left). Nodes deeper
    than a row's k hold 0."""
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
