"""A static token tree drafted by an EAGLE / EAGLE-3 head, level by level over its own KV pool.

The round starts where a chain round starts: the catch-up feeds the pending target features
with the tokens after them, the last pair being (f_{n-1}, g) at the head's storage position
`base`. The head's output there, x_g, gives the root's children (depth-1 nodes). Level d =
1 .. k_b - 1 then feeds the depth-d nodes in one flat head pass (`eagle_round.head_pass`),
a row per request carrying the level's tree rule (`TreeChunk.rule`), each node fed (its
parent's output, its own token): a depth-1 node reads x_g, a deeper one the output of its
parent's row at the level before. The storage convention is the target's verification
block (`TreeChunk`) with g's feed as row 0: node i is stored at base + 1 + i, at rotary
position base + depth(i), and sees the head's context, g's feed, its ancestors and itself
(`TreeChunk.level`'s mask). Its output gives its children. A row's deepest level is never
fed, as a chain's last draft is not.

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

from infer.cache.forward_batch import Row, plan_batch
from infer.models.eagle import EagleHead
from infer.speculative.eagle_round import head_pass
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import TreeChunk, TreeShape
from infer.speculative.tree_expand import expand_levels
from infer.transfer import tensor_on

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


def expand_head_tree(head: EagleHead, pool: CachePoolProtocol, reqs: Sequence[DraftRequest], slots: Sequence[int],
                     bases: Sequence[int], root: torch.Tensor, ks: Sequence[int], shape: TreeShape
                     ) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
    """Levels 0 .. max(ks) - 1 of each row's tree (`tree_expand.expand_levels`): a level's
    state is the head's output after each of its nodes [A', P, H]; a deeper level is one head
    pass over its nodes, a row each with the level's tree rule, each node fed its parent's
    output (module docstring). bases: each row's storage position of g's feed; root: the
    head's output there [A, H]; ks: depth limits."""

    def feed(d: int, alive: list[int], keep: list[int], level_tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        feats = x[tensor_on(keep, x.device, torch.long)].repeat_interleave(shape.branching[d], dim=1)  # [A'', P, H]
        rule = TreeChunk.level(shape, d + 1).rule()
        rows = [Row(slots[a], bases[a] + 1 + lo, [0] * (hi - lo), logits=hi - lo, tree=rule) for a in alive]
        out = head_pass(head, pool, plan_batch(rows), feats.reshape(-1, feats.shape[-1]), level_tokens.reshape(-1))
        return out.view(len(alive), hi - lo, -1)  # [A'', P, H]

    return expand_levels(reqs, ks, shape, root.device, root[:, None], lambda x: head.logits(x.reshape(-1, x.shape[-1])),
                         feed)
