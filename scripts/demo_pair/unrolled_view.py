"""The attention of EAGLE-3's training-time test: a head unrolled over its own draft steps.

EAGLE-3 (Li et al., 2025, "training-time test") trains a head on the inputs it meets when
drafting. Pass 0 feeds position i the pair (f_i, t_{i+1}) with the target's feature f_i;
pass j >= 1 feeds it (x^{j-1}_{i-1}, t_{i+1}), the head's own output of the pass before at
the previous position, as draft step j + 1 does. At draft step j + 1 the query at position
i sees the cache of the target-fed positions up to i - j and the draft steps after them,
one each at positions i - j + 1 .. i: so in training the pass-j query at i attends to the
pass-0 keys at positions <= i - j and, for each pass m in 1..j, the pass-m key at position
i - (j - m) (a diagonal). `UnrolledView` keeps the keys and values of the passes so far
(with their gradients) and applies that mask; pass 0 is plain causal attention.
"""

from __future__ import annotations

import torch

from infer.models.layers.attention import masked_attention
from infer.models.layers.rotary import rotary_qk


def unrolled_mask(seq_len: int, passes: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool [S, passes * S]: key (m, s) visible to a query at position i of pass `passes - 1`
    (keys laid out pass after pass)."""
    j = passes - 1
    i = torch.arange(seq_len, device=device)[:, None]  # [S, 1]
    s = torch.arange(seq_len, device=device)[None, :]  # [1, S]
    blocks = [s <= i - j]  # pass 0: causal, shifted back by j
    blocks += [s == i - (j - m) for m in range(1, passes)]
    return torch.cat(blocks, dim=1)


class UnrolledView:
    """An AttentionView for a one-layer head run pass after pass over the same positions:
    call `attend` once a pass (layer 0 only); keys and values accumulate until `reset`."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []  # per pass [B, S, Hkv, D]
        self.values: list[torch.Tensor] = []

    def reset(self) -> None:
        self.keys, self.values = [], []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [B, S, Hq, D], k, v [B, S, Hkv, D] of this pass -> [B, S, Hq, D]."""
        if layer != 0:
            raise ValueError("UnrolledView serves a one-layer head (layer 0)")
        if rotary is not None:
            q, k = rotary_qk(q, k, rotary[0], rotary[1])
        self.keys.append(k)
        self.values.append(v)
        b, s = q.shape[:2]
        mask = unrolled_mask(s, len(self.keys), q.device).expand(b, s, -1)  # [B, S, passes * S]
        return masked_attention(q, torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1), mask)
