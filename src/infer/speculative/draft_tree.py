"""Tree drafting with a draft model: a static tree expanded level by level.

`DraftModelProposer.propose_tree` / `on_tree_accepted` call these functions; they work on
the proposer's own state (its slot map, catch-up and round bookkeeping) as a companion
module of `draft_model.py`. One round for the requests that draft (depth limit k_b >= 1),
n = the request's computed tokens (g = tokens[n] is pending):

1. catch-up exactly as a chain round: long gaps as prefill chunks, the rest fed with g;
2. level 0: one batched draft step over the unseen tail, ending with g at position n; its
   logits (after g) give the root's children;
3. level d = 1 .. k_b - 1: one batched `ForwardFn.tree` over the depth-d nodes of the rows
   still expanding. Node i is stored at n + 1 + i of the draft's slot (the target's
   verification convention), at rotary position n + d, and sees the context, g, its
   ancestors and itself (`TreeChunk.level`). Its logits give the depth-(d+1) children. A
   row's deepest level is never fed, as a chain's last draft is not.

Children of a node: greedy rows take the top-b tokens of the draft's (penalised) logits in
rank order (distinct); sampled rows draw b distinct tokens from q, the draft distribution
after the request's sampling transforms, without replacement: sibling j is drawn from q
renormalised over the tokens siblings 1 .. j-1 took (`sample_without_replacement`), and that
is the q reported for it, so the verifier's rule (`tree_verify`) stays exact while no node
repeats a sibling. A sibling that finds no mass left (q with fewer than b tokens) is absent,
with its descendants. Node i is drawn with uniform i of N drawn per round from the request's
own generator, so a seeded request's draft never depends on its batch. Greedy rows report
no q (one-hot).

After verification `accept_paths` moves the accepted nodes the draft was fed into sequence
order and truncates its cache to n + 1 + min(L, k_b - 1): what a chain round of k_b drafts
with the same accepted prefix leaves behind, so the next round's catch-up is the chain's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.compaction import PathMove, move_paths
from infer.cache.view import BatchLayout
from infer.sampling import SamplingParams, adjust_logits, draw_uniforms, sample_without_replacement
from infer.speculative.tree import TreeChunk, TreeDraft, TreeShape
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.engine.request import Request
    from infer.speculative.draft_model import DraftModelProposer


def fed_positions(shape: TreeShape, depth: int) -> int:
    """Positions a round of depth limit `depth` >= 1 writes to the draft's cache from g on:
    g, then the nodes of depths 1 .. depth - 1."""
    return 1 + shape.level_starts[depth - 1]


def propose_tree(proposer: DraftModelProposer, requests: Sequence[Request], shape: TreeShape,
                 depths: Sequence[int]) -> list[TreeDraft]:
    """`Proposer.propose_tree` for a draft model (module docstring)."""
    if len(depths) != len(requests):
        raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
    drafts = [TreeDraft.empty(shape) for _ in requests]
    active = [i for i, k in enumerate(depths)
              if k > 0 and proposer.take_slot(requests[i], fed_positions(shape, k))]
    if not active:
        return drafts
    reqs = [requests[i] for i in active]
    ks = [min(depths[i], shape.depth) for i in active]
    proposer.catch_up([r for r in reqs if proposer.behind(r)])
    tokens, probs, drawn = expand(proposer, reqs, ks, shape)
    n = shape.num_nodes
    for j, (i, r, k) in enumerate(zip(active, reqs, ks, strict=True)):
        keep = shape.level_starts[k]
        valid = [False] * n
        for node in range(keep):  # breadth-first: a parent's flag is set before its children's
            parent = shape.parents[node]
            valid[node] = bool(drawn[j][node]) and (parent < 0 or valid[parent])
        row_probs = None if probs is None or r.sampling_params.greedy else probs[j]
        drafts[i] = TreeDraft(shape, tuple(t if ok else 0 for t, ok in zip(tokens[j], valid, strict=True)),
                              tuple(valid), row_probs)
        proposer.rounds[r.request_id] = (r.num_computed_tokens, k)
    return drafts


def expand(proposer: DraftModelProposer, reqs: Sequence[Request], ks: Sequence[int],
           shape: TreeShape) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
    """Levels 0 .. max(ks) - 1 -> (tokens [A][N] on the host, probs [A, N, V] on the device
    or None when every row is greedy, drawn [A][N] on the host: 0 where a sibling found no
    mass left). Nodes deeper than a row's k hold 0."""
    device = proposer.device
    batch, n_nodes = len(reqs), shape.num_nodes
    slots = [proposer.slot(r) for r in reqs]
    params = [r.sampling_params for r in reqs]
    all_greedy = all(p.greedy for p in params)
    base_contexts = [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None
    uniforms = None if all_greedy else to_device(draw_uniforms([r.generator for r in reqs], n_nodes), device)  # [A, N]
    tokens = torch.zeros((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    drawn = torch.ones((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    probs_out: torch.Tensor | None = None
    # level 0: the unseen tail tokens[d : n + 1] (g last)
    starts = [proposer.pool.seq_len(s) for s in slots]
    feeds = [r.token_slice(d) for r, d in zip(reqs, starts, strict=True)]
    ids = torch.zeros((batch, max(len(f) for f in feeds)), dtype=torch.long)
    for b, f in enumerate(feeds):
        ids[b, :len(f)] = torch.tensor(f)
    layout = BatchLayout.of(slots, starts, [len(f) for f in feeds])
    logits = proposer.step_forward(ids, layout, all_logits=False)[:, None]  # [A, 1, V]
    alive = list(range(batch))
    host: list[list[int]] = []  # tokens on the host, for penalty contexts only (from depth 1 on)
    for d, width in enumerate(shape.branching):  # parents at depth d, children at depth d + 1
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        rows = tensor_on(alive, device, torch.long)  # [A']
        contexts = None
        if base_contexts is not None:
            parents: Sequence[int | None] = range(shape.level_starts[d - 1], lo) if d else [None]
            contexts = [base_contexts[a] + ([] if p is None else [host[a][j] for j in shape.paths[p]])
                        for a in alive for p in parents]
        flat = logits.reshape(-1, logits.shape[-1])  # [A' * P, V]
        kids, q, ok = children(flat, [params[a] for a in alive for _ in range(logits.shape[1])], contexts, width,
                               None if uniforms is None else uniforms[rows, lo:hi].reshape(-1))
        tokens[rows, lo:hi] = kids.view(len(alive), hi - lo)
        if ok is not None:
            drawn[rows, lo:hi] = ok.view(len(alive), hi - lo).long()
        if q is not None:
            if probs_out is None:
                probs_out = torch.zeros((batch, n_nodes, q.shape[-1]), dtype=q.dtype, device=device)
            probs_out[rows, lo:hi] = q.view(len(alive), hi - lo, -1)
        alive = [a for a in alive if ks[a] > d + 1]
        if not alive:
            break
        if base_contexts is not None:
            host = tokens.tolist()  # (a sync per level, only when a penalty reads the contexts)
        chunk = TreeChunk.level(shape, d + 1)
        level = BatchLayout.of([slots[a] for a in alive], [reqs[a].num_computed_tokens + 1 + lo for a in alive],
                               [hi - lo] * len(alive))
        logits = proposer.step_forward.tree(tokens[tensor_on(alive, device, torch.long), lo:hi], level,
                                            chunk)  # [A'', P, V]
    host = torch.cat([tokens, drawn], dim=1).tolist()  # (the one sync of a round without penalties)
    return [row[:n_nodes] for row in host], probs_out, [row[n_nodes:] for row in host]


def children(logits: torch.Tensor, params: Sequence[SamplingParams], contexts: Sequence[list[int]] | None,
             width: int, uniforms: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`width` children per parent: logits [M, V] (one row per parent), the parents' params
    and contexts (None: no penalties), uniforms [M * width] (None: every row greedy) ->
    (tokens [M * width] parent-major, q [M * width, V] float32 or None, drawn [M * width]
    bool or None; both None when every row is greedy). Greedy rows: the top-`width` tokens;
    others: distinct draws from softmax(adjusted), without replacement (module docstring)."""
    adjusted = adjust_logits(logits, params, contexts)  # [M, V] float32
    greedy = [p.greedy for p in params]
    top = adjusted.topk(width, dim=-1).indices.reshape(-1) if any(greedy) else None  # [M * width]
    if uniforms is None or all(greedy):
        assert top is not None
        return top, None, None
    ids, dists, ok = sample_without_replacement(torch.softmax(adjusted, dim=-1), uniforms.view(-1, width))
    sampled, q, ok = ids.reshape(-1), dists.reshape(-1, dists.shape[-1]), ok.reshape(-1)  # [M * width] ...
    if top is None:
        return sampled, q, ok
    mask = tensor_on(greedy, logits.device, torch.bool).repeat_interleave(width)  # [M * width]
    return torch.where(mask, top, sampled), q, mask | ok


def accept_paths(proposer: DraftModelProposer, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
    """`Proposer.on_tree_accepted` for a draft model: the fed part of each accepted path
    into sequence order (one gather + scatter for the batch), then each slot truncated."""
    moves: list[PathMove] = []
    ends: list[tuple[int, int]] = []
    for request, nodes in zip(requests, paths, strict=True):
        n, k = proposer.rounds.pop(request.request_id, (None, 0))
        if n is None:
            continue
        fed = min(len(nodes), k - 1)
        slot = proposer.slot(request)
        moves.append(PathMove(slot, n, tuple(nodes[:fed])))
        ends.append((slot, n + 1 + fed))
    move_paths(proposer.pool, moves)
    for slot, end in ends:
        proposer.pool.truncate_to(slot, min(end, proposer.pool.seq_len(slot)))
