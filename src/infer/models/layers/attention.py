"""Attention views: how one forward pass reaches its keys and values.

The model computes rotated q, k, v for the tokens of a batch and hands them to an
`AttentionView`. The view decides where the new k, v go (nowhere, or a KV pool's slots) and
which keys each query may see. The model never knows about caches. The engine's view is the
flat batch's (`paged_attention.BatchView`: every pass of the target, a draft model and an
EAGLE head); `NoCacheView` attends within right-padded rows [B, T] alone (training, tests).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from infer.models.layers.rotary import rotary_qk


class AttentionView(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (new tokens) -> [B, T, Hq, D].

        With `rotary` (cos, sin: [B, T, 1, D]), q and k arrive unrotated and the view rotates
        them (`rotary.rotary_qk`'s math) as it stores k and v: a view with a cache on a GPU
        does the rotation and its cache write in one kernel."""
        ...


def position_mask(q_pos: torch.Tensor, ctx_end: torch.Tensor, s: int) -> torch.Tensor:
    """Boolean [B, T, S]: key j is visible to the query at absolute position q_pos[b, t] iff
    j <= q_pos (causal) and j < ctx_end[b] (no padded keys). q_pos: [B, T]; ctx_end: [B].
    Padded queries still see key 0, so their (ignored) outputs stay finite."""
    k_pos = torch.arange(s, device=q_pos.device)
    return (k_pos <= q_pos[:, :, None]) & (k_pos < ctx_end[:, None, None])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with an explicit mask.

    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; mask: [B, T, S] bool -> [B, T, Hq, D].
    """
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
