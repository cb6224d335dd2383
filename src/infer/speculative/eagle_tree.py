"""A static token tree drafted by an EAGLE / EAGLE-3 head, level by level over its own KV pool.

`expand_head_tree` starts after a chain round's catch-up, whose last pair (f_{n-1}, g) sits
at the head's storage position `base`: the head's output there gives the root's children.
Level d = 1 .. k_b - 1 feeds the depth-d nodes in one flat head pass (`eagle_round.head_pass`,
a row per request with the level's `TreeChunk` rule), each node fed (its parent's output,
its own token), stored at base + 1 + i with rotary position base + depth(i). Children are
chosen as a draft model's (`tree_expand.children`), from the head's logits over target ids;
the deepest level is never fed. After verification the proposer drops the round's positions.
Details: docs/speculation.md, "An EAGLE head".
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
