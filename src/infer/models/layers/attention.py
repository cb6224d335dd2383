"""Attention views: how one forward pass reaches its keys and values.

The model hands q, k, v to an `AttentionView`, which decides where the new k, v go and which
keys each query sees; the model never knows about caches. The engine's view is
`paged_attention.BatchView`; `NoCacheView` attends within right-padded rows (training, tests).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from infer.models.layers.rotary import rotary_qk


class AttentionView(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (new tokens) -> [B, T, Hq, D]. With `rotary`
        (cos, sin: [B, T, 1, D]), q and k arrive unrotated and the view rotates them (`rotary_qk`)."""
        ...


def position_mask(q_pos: torch.Tensor, ctx_end: torch.Tensor, s: int) -> torch.Tensor:
    """Boolean [B, T, S]: key j visible to the query at q_pos[b, t] iff j <= q_pos and j < ctx_end[b].
    q_pos: [B, T]; ctx_end: [B]. Padded queries still see key 0 (finite outputs)."""
    k_pos = torch.arange(s, device=q_pos.device)
    return (k_pos <= q_pos[:, :, None]) & (k_pos < ctx_end[:, None, None])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: q [B, T, Hq, D]; k, v [B, S, Hkv, D]; mask [B, T, S] bool -> [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T|S, D]
        attn_mask=mask[:, None, :, :], enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class NoCacheView:
    """Attention within the batch only: causal, right padding masked. Training and tests."""

    def __init__(self, chunk_lens: torch.Tensor | None = None) -> None:
        self.chunk_lens = chunk_lens  # [B] valid tokens per row; None = all valid

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rotary is not None:
            q, k = rotary_qk(q, k, rotary[0], rotary[1])
        b, t = q.shape[:2]
        if self.chunk_lens is None:
            groups = q.shape[2] // k.shape[2]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2).repeat_interleave(groups, dim=1),
                v.transpose(1, 2).repeat_interleave(groups, dim=1),
                is_causal=True)
            return out.transpose(1, 2)
        q_pos = torch.arange(t, device=q.device).expand(b, t)
        mask = position_mask(q_pos, self.chunk_lens.to(q.device), t)
        return masked_attention(q, k, v, mask)
