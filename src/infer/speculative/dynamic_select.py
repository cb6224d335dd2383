"""Dynamic token trees (EAGLE-2, Li et al. 2024): which drafted nodes a round keeps, losslessly.

Slots (the c-th child of a frontier node) are scored before their draw (`slot_scores`) and ranked in one total
order: a level's best are the next frontier (`best_slots`), the round's N best the tree (`kept_tree`). Whether a
sampled child is kept never depends on its own draw, so the verifier stays exact. The argument: docs/speculation.md,
"Dynamic trees"."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling import SamplingParams, adjust_logits, sample_without_replacement
from infer.transfer import tensor_on

NEG_INF = float("-inf")


def draw_children(logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[list[int]] | None,
                  width: int, uniforms: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`width` children per parent: logits [M, V], the parents' params and contexts (None: no
    penalties), uniforms [M, width] (None: every row greedy) -> (tokens [M, width], q [M, width, V]
    float32 each was drawn from (None if all greedy), drawn [M, width] bool, base [M, V] float32:
    the parent's distribution). Greedy rows take the top tokens; others draw without replacement."""
    adjusted = adjust_logits(logits, params, contexts)  # [M, V] float32
    base = torch.softmax(adjusted, dim=-1)  # [M, V]
    greedy = [p.greedy for p in params]
    top = adjusted.topk(width, dim=-1).indices if any(greedy) else None  # [M, width]
    if uniforms is None or all(greedy):
        assert top is not None
        return top, None, torch.ones_like(top, dtype=torch.bool), base
    ids, dists, ok = sample_without_replacement(base, uniforms)  # [M, width], [M, width, V], [M, width]
    if top is None:
        return ids, dists, ok, base
    mask = tensor_on(greedy, logits.device, torch.bool)[:, None]  # [M, 1]
    return torch.where(mask, top, ids), dists, mask | ok, base


def slot_scores(base: torch.Tensor, tokens: torch.Tensor, drawn: torch.Tensor, parent_path: torch.Tensor,
                parent_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot scores of M parents' children, min(parent path x best q the elder siblings left, parent
    score): base [M, V], tokens / drawn [M, W] in draw order, parent_path / parent_score [M] float64
    -> (scores [M, W] float64, -inf where nothing was drawn; paths [M, W] float64)."""
    rest = base.to(torch.float64, copy=True)  # [M, V]: q over the tokens not taken yet
    best_left = []
    for c in range(tokens.shape[1]):
        best_left.append(rest.max(dim=-1).values)  # [M]
        rest.scatter_(1, tokens[:, c:c + 1], 0.0)
    left = torch.stack(best_left, dim=1)  # [M, W]
    scores = torch.minimum(parent_path[:, None] * left, parent_score[:, None])  # [M, W]
    scores = torch.where(drawn, scores, NEG_INF)
    paths = parent_path[:, None] * base.gather(1, tokens).to(torch.float64)  # [M, W]
    return scores, paths


def best_slots(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best slots a row (score descending, then index), in index order: scores [A, M] ->
    (indices [A, min(k, M)] long, ok bool; slots of score -inf are not ok and come last)."""
    k = min(k, scores.shape[1])
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [A, k]
    ok = scores.gather(1, ranked) > NEG_INF  # [A, k]
    key = torch.where(ok, ranked, ranked + scores.shape[1])  # invalid ones after the valid
    order = key.argsort(dim=1)  # [A, k]
    return ranked.gather(1, order), ok.gather(1, order)


def kept_tree(selected: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The kept nodes' parent array: selected candidate indices in storage order, parents[c]
    candidate c's parent (-1: the root) -> node i's parent node; a parent left out raises."""
    where = {c: i for i, c in enumerate(selected)}
    out = []
    for c in selected:
        parent = parents[c]
        if parent >= 0 and parent not in where:
            raise AssertionError(f"candidate {c} kept without its parent {parent}")
        out.append(-1 if parent < 0 else where[parent])
    return out
