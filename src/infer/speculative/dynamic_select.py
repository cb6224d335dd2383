"""Dynamic token trees (EAGLE-2 style): which drafted nodes a round keeps, and why that stays lossless.

Theory: Y. Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees" (2024): expand, level by level, the nodes whose draft path probability (the product
of the draft's q along the path) is highest, then rerank every drafted node by the same
value and verify the best N. Each level costs one batched draft step over its frontier.

Here a level works on *slots*: the c-th child of a frontier node v is a slot, scored before
its token is drawn, with

    score(v, c) = min(pathprob(v) * max q_v over the tokens v's elder siblings left,
                      score of v's own slot)

(pathprob(v) = the product of q along v's path; the root has pathprob 1 and an unbounded
score). For greedy rows the children are the draft's top tokens in rank order, so the max
left is exactly the child's own q and the score is EAGLE-2's value, pathprob(child). Sampled
rows draw the children without replacement from q (`sample_without_replacement`), and the
score is the value of the best token the draw could take.

Selection, in a fixed total order (score descending, ties broken by storage order: depth,
then parent, then sibling index, so a node's ancestors and elder siblings come first):
  * the next frontier is the `branch` best slots of the level;
  * the tree is the N best slots of the round.

Why that is exact (the verifier is iterative speculative sampling, verifier.py). Its
argument needs, for the c-th child x of a node v tried after v's elder siblings were
rejected: given everything the verifier has seen, and given that x is in the tree at all, x
is distributed as the q reported for it (q renormalised over the tokens the elder siblings
took). Being in the tree is a function of the slots ranked above x's slot: the slots of
x's younger siblings and of x's descendants rank below it (their scores are bounded by
x's slot's score by the min, and ties go to the elder / the ancestor), so they never decide
it; every slot ranked above it is drawn from uniforms other than x's and from tokens drawn
before x. Its score itself depends only on v's path and on the elder siblings. So the event
"x is kept" is independent of x's own draw, and the reported q holds. Ranking nodes by their
OWN path probability instead (what EAGLE-2 does with deterministic top-k drafts) would keep
a sampled child because of its own q, biasing the kept children towards the draft's
favourite tokens: not lossless (the negative control of the tests). The same order also
makes every kept set closed under parents and elder siblings, so the kept children of a
node are a prefix of its draw order and the tree is connected. Greedy rows' children are
deterministic (one-hot q), exact under any selection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling import SamplingParams, adjust_logits, sample_without_replacement
from infer.transfer import tensor_on

NEG_INF = float("-inf")


def draw_children(logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[list[int]] | None,
                  width: int, uniforms: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """`width` children per parent: logits [M, V] (one row per parent), the parents' params
    and contexts (None: no penalties), uniforms [M, width] (None: every row greedy) ->
    (tokens [M, width], q [M, width, V] float32 each child was drawn from (None when every
    row is greedy), drawn [M, width] bool, base [M, V] float32: the parent's distribution
    (softmax of the adjusted logits; a greedy row's without temperature)). Greedy rows take
    the top-`width` tokens in rank order; others draw distinct tokens without replacement."""
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
    """Scores of the slots of M parents (module docstring) and their children's path
    probabilities: base [M, V] (each parent's q), tokens / drawn [M, W] (its children in draw
    order), parent_path / parent_score [M] float64 (-inf score: no parent) -> (scores [M, W]
    float64, -inf where nothing was drawn; paths [M, W] float64)."""
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
    """The k best slots a row in the total order (score descending, then index ascending),
    returned in index order: scores [A, M] -> (indices [A, min(k, M)] long, ok [A, min(k, M)]
    bool; slots of score -inf are not ok and come last)."""
    k = min(k, scores.shape[1])
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [A, k]
    ok = scores.gather(1, ranked) > NEG_INF  # [A, k]
    key = torch.where(ok, ranked, ranked + scores.shape[1])  # invalid ones after the valid
    order = key.argsort(dim=1)  # [A, k]
    return ranked.gather(1, order), ok.gather(1, order)


def kept_tree(selected: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The kept nodes' parent array: selected, candidate indices in storage order (a
    candidate's parent is stored before it); parents[c], candidate c's parent candidate (-1:
    the root) -> node i's parent node (-1: the root). A parent left out is an error (the
    order keeps every kept node's ancestors)."""
    where = {c: i for i, c in enumerate(selected)}
    out = []
    for c in selected:
        parent = parents[c]
        if parent >= 0 and parent not in where:
            raise AssertionError(f"candidate {c} kept without its parent {parent}")
        out.append(-1 if parent < 0 else where[parent])
    return out
