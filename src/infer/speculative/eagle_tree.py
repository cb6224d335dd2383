"""A static token tree drafted by an EAGLE / EAGLE-3 head, level by level over its own KV pool:
node i fed (its parent's output, its token) at base + 1 + i, rotated at base + depth(i).
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
    """Levels 0 .. max(ks) - 1 of each row's tree (`tree_expand.expand_levels`), a level's state
    the head's output after each node [A', P, H]. bases: each row's storage position of g's feed;
    root: the head's output there [A, H]; ks: depth limits."""

    def feed(d: int, alive: list[int], keep: list[int], level_tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
        feats = x[tensor_on(keep, x.device, torch.long)].repeat_interleave(shape.branching[d], dim=1)  # [A'', P, H]
        rule = TreeChunk.level(shape, d + 1).rule()
        rows = [Row(slots[a], bases[a] + 1 + lo, [0] * (hi - lo), logits=hi - lo, tree=rule) for a in alive]
        out = head_pass(head, pool, plan_batch(rows), feats.reshape(-1, feats.shape[-1]), level_tokens.reshape(-1))
        return out.view(len(alive), hi - lo, -1)  # [A'', P, H]

    return expand_levels(reqs, ks, shape, root.device, root[:, None], lambda x: head.logits(x.reshape(-1, x.shape[-1])),
                         feed)
