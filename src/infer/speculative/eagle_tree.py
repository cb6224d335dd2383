"""A static token tree drafted by an EAGLE / EAGLE-3 head, level by level over its own KV pool.

The round starts where a chain round starts: the catch-up feeds the pending target features
with the tokens after them, the last pair being (f_{n-1}, g) at the head's storage position
`base`. The head's output there, x_g, gives the root's children (depth-1 nodes). Level d =
1 .. k_b - 1 then feeds the depth-d nodes in one batched forward (`head_tree_level`), each
node fed (its parent's output, its own token): a depth-1 node reads x_g, a deeper one the
output of its parent's row at the level before. The storage convention is the target's
verification block (`TreeChunk`) with g's feed as row 0: node i is stored at base + 1 + i,
at rotary position base + depth(i), and sees the head's context, g's feed, its ancestors
and itself (`TreeChunk.level`'s mask). Its output gives its children. A row's deepest
level is never fed, as a chain's last draft is not.

Children are chosen as the draft model chooses them (`draft_model.children`): greedy rows
take the top-b tokens of the head's logits over target ids, sampled rows draw b distinct
tokens from q (the head's distribution after the request's sampling transforms) without
replacement, each sibling reporting the renormalised q it was drawn from, so the tree
verifier's rule stays exact. Node i uses uniform i of N drawn per round from the request's
own generator. After verification the proposer drops every position of the round past
g's feed; the accepted tokens come back with the target's features and are fed at the next
catch-up, as after a chain round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.view import BatchLayout, BlockMask, CacheView
from infer.models.eagle import EagleHead
from infer.sampling import draw_uniforms
from infer.speculative.draft_model import children
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import TreeChunk, TreeShape
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


def head_tree_level(head: EagleHead, pool: CachePoolProtocol, ids: torch.Tensor, features: torch.Tensor,
                    layout: BatchLayout, chunk: TreeChunk) -> torch.Tensor:
    """One tree chunk through the head: ids [B, P] (CPU or the device), features [B, P, H]
    (each node's parent's output), layout: each row P wide from its chunk's storage start ->
    outputs x [B, P, H]. Rotary positions and visibility come from the tree; commits the layout."""
    if layout.width != chunk.width:
        raise ValueError(f"a tree chunk of {chunk.width} rows needs a layout {chunk.width} wide, got {layout.width}")
    device = features.device
    indices = pool.indices(layout).to(device)
    view = CacheView(pool.k_cache, pool.v_cache, indices, block=BlockMask(chunk.mask(device), chunk.first_row))
    positions = indices.q_pos[:, :1] + chunk.rotary_offsets(device)[None, :]  # [B, P]
    x = head(to_device(ids, device), features, positions, view)
    pool.commit(layout)
    return x


def expand_head_tree(head: EagleHead, pool: CachePoolProtocol, reqs: Sequence[DraftRequest], slots: Sequence[int],
                     bases: Sequence[int], root: torch.Tensor, ks: Sequence[int], shape: TreeShape
                     ) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
    """Levels 0 .. max(ks) - 1 of each row's tree (module docstring). bases: each row's
    storage position of g's feed; root: the head's output there [A, H]; ks: depth limits.
    Returns (tokens [A][N] on the host, q [A, N, V] on the device or None when every row is
    greedy, drawn [A][N] on the host: 0 where a sibling found no mass left). Nodes deeper
    than a row's k hold 0."""
    device = root.device
    batch, n_nodes = len(reqs), shape.num_nodes
    params = [r.sampling_params for r in reqs]
    base_contexts = [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None
    uniforms = (None if all(p.greedy for p in params)  # [A, N]
                else to_device(draw_uniforms([r.generator for r in reqs], n_nodes), device))
    tokens = torch.zeros((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    drawn = torch.ones((batch, n_nodes), dtype=torch.long, device=device)  # [A, N]
    probs_out: torch.Tensor | None = None
    x = root[:, None]  # [A', P, H]: outputs of the parents of the level being chosen (the root: g's)
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
        logits = head.logits(x.reshape(-1, x.shape[-1]))  # [A' * P, V] over target ids
        kids, q, ok = children(logits, [params[a] for a in alive for _ in range(x.shape[1])], contexts, width,
                               None if uniforms is None else uniforms[rows, lo:hi].reshape(-1))
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
        feats = x[tensor_on(keep, device, torch.long)].repeat_interleave(width, dim=1)  # [A'', P * width, H]
        layout = BatchLayout.of([slots[a] for a in alive], [bases[a] + 1 + lo for a in alive], [hi - lo] * len(alive))
        x = head_tree_level(head, pool, tokens[tensor_on(alive, device, torch.long), lo:hi], feats, layout,
                            TreeChunk.level(shape, d + 1))
    out = torch.cat([tokens, drawn], dim=1).tolist()  # (the one sync of a round without penalties)
    return [row[:n_nodes] for row in out], probs_out, [row[n_nodes:] for row in out]
