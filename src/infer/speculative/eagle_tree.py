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
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import TreeChunk, TreeShape
from infer.speculative.tree_expand import expand_levels
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
    """Levels 0 .. max(ks) - 1 of each row's tree (`tree_expand.expand_levels`): a level's
    state is the head's output after each of its nodes [A', P, H]; a deeper level feeds each
    node with its parent's output (module docstring). bases: each row's storage position of
    g's feed; root: the head's output there [A, H]; ks: depth limits."""

    def feed(d: int, alive: list[int], keep: list[int], level_tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        feats = x[tensor_on(keep, x.device, torch.long)].repeat_interleave(shape.branching[d], dim=1)  # [A'', P, H]
        layout = BatchLayout.of([slots[a] for a in alive], [bases[a] + 1 + lo for a in alive], [hi - lo] * len(alive))
        return head_tree_level(head, pool, level_tokens, feats, layout, TreeChunk.level(shape, d + 1))

    return expand_levels(reqs, ks, shape, root.device, root[:, None], lambda x: head.logits(x.reshape(-1, x.shape[-1])),
                         feed)
