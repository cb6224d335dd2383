"""Attention over a ForwardBatch: where a pass's keys and values go and which keys each token sees.

`BatchView` writes each token's k, v to its KV slot and attends each row by the kernel routes.py
gives it, or `reference_attention` (masked SDPA). Token i of row b sees key j iff j <= positions[i]
and j < seq_lens[b], and inside a tree block only its ancestors."""

from __future__ import annotations

import itertools

import torch

from infer.models.batch import WORD, ForwardBatch
from infer.models.kernels.arrivals import ArrivalCounters
from infer.models.kernels.routes import AttentionRoutes, rotary_write_fused
from infer.models.layers.attention import masked_attention
from infer.models.layers.rotary import rotary_qk
from infer.transfer import tensor_on


def write_kv(kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rotary: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor) -> torch.Tensor:
    """Write k, v [B, T, Hkv, D] to storage rows `slots` [B * T], rotating q and k first with `rotary`
    (cos, sin); returns q (rotated if asked)."""
    if rotary is not None and rotary_write_fused(q):
        from infer.models.kernels.rotary_write import rotary_kv_write
        return rotary_kv_write(q, k, v, rotary[0], rotary[1], kc, vc, slots)
    if rotary is not None:
        q, k = rotary_qk(q, k, rotary[0], rotary[1])
    heads, dim = kc.shape[1], kc.shape[2]
    kc.index_copy_(0, slots, k.reshape(-1, heads, dim).to(kc.dtype))
    vc.index_copy_(0, slots, v.reshape(-1, heads, dim).to(vc.dtype))
    return q


def key_rows(block_tables: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """[B, width] storage rows of key positions 0 .. width - 1 of each row (past its blocks: to be masked)."""
    j = torch.arange(width, device=block_tables.device)
    blocks = block_tables.index_select(1, (j // block_size).clamp(max=block_tables.shape[1] - 1))
    return blocks * block_size + j % block_size


def reference_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: ForwardBatch,
                        rows: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The visibility rule by gathered keys and masked SDPA: q [N, Hq, D] -> the tokens of `rows`
    (default all) written into `out` [N, Hq, D]. One-token rows are padded apart from longer ones."""
    out = torch.zeros_like(q) if out is None else out
    rows = list(range(batch.num_rows)) if rows is None else rows
    for group in ([b for b in rows if batch.query_lens[b] == 1], [b for b in rows if batch.query_lens[b] > 1]):
        if group:
            _attend_group(q, kc, vc, batch, group, out)
    return out


def _attend_group(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: ForwardBatch, group: list[int],
                  out: torch.Tensor) -> None:
    device = q.device
    width = max(batch.query_lens[b] for b in group)
    picked = tensor_on(group, device, torch.long)  # [R]
    first = batch.query_start.index_select(0, picked)  # [R]
    cols = torch.arange(width, device=device)
    lens = tensor_on([batch.query_lens[b] for b in group], device, torch.long)  # [R]
    valid = cols[None, :] < lens[:, None]  # [R, T]
    tokens = torch.where(valid, first[:, None] + cols[None, :], 0)  # [R, T]
    s = batch.context_width
    keys = key_rows(batch.block_tables.index_select(0, picked), batch.block_size, s)  # [R, S]
    j = torch.arange(s, device=device)
    pos = batch.positions[tokens]  # [R, T]
    mask = (j <= pos[:, :, None]) & (j < batch.seq_lens.index_select(0, picked)[:, None, None])  # [R, T, S]
    if batch.tree is not None:
        rel = j - batch.tree.base[tokens][:, :, None]  # [R, T, S]
        inside = (rel >= 0) & (rel < batch.tree.width)
        rel = rel.clamp(min=0, max=batch.tree.width - 1)
        word = batch.tree.bits[tokens].gather(2, rel // WORD)  # [R, T, S]: the word holding each key's bit
        mask &= ((word >> (rel % WORD)) & 1).bool() | ~inside
    mask |= ~valid[:, :, None] & (j == 0)  # (a padding query sees key 0: finite, dropped)
    y = masked_attention(q[tokens], kc[keys].to(q.dtype), vc[keys].to(q.dtype), mask)  # [R, T, Hq, D]
    out[tokens[valid]] = y[valid]


class BatchView:
    """The AttentionView of one pass over a ForwardBatch and a pool's caches: q, k, v are [1, N, H, D]."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                 arrivals: ArrivalCounters) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, rows, Hkv, D]
        self.arrivals = arrivals
        self.batch = batch
        self.routes = AttentionRoutes.of(batch.query_lens, None if batch.tree is None else batch.tree.width)
        self.query_start = [0, *itertools.accumulate(batch.query_lens)]  # host [B + 1]
        self.short_tokens: torch.Tensor | None = None  # the split-KV kernel's tokens (None: every token)
        if self.routes.prefill and self.routes.split_kv:
            picked = [t for b in self.routes.split_kv for t in range(self.query_start[b], self.query_start[b + 1])]
            self.short_tokens = tensor_on(picked, batch.token_ids.device, torch.long)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [rows, Hkv, D]
        q = write_kv(kc, vc, q, k, v, rotary, self.batch.slots)  # [1, N, Hq, D]
        return self.attend_written(q[0], kc, vc)[None]

    def attend_written(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Attention of q [N, Hq, D] (rotated) over each row's keys, this pass's already in kc, vc."""
        batch = self.batch
        if self.routes.reference(q):
            return reference_attention(q, kc, vc, batch)
        from infer.models.kernels.prefill_attention import prefill_attention
        from infer.models.kernels.split_attention import split_attention
        out = torch.empty_like(q)
        tree = None if batch.tree is None else (batch.tree.bits[:, 0].contiguous(), batch.tree.base, batch.tree.width)
        if self.routes.split_kv:
            split_attention(q, kc, vc, batch.token_rows, batch.query_start, batch.positions, batch.seq_lens,
                            batch.block_tables, batch.block_size, batch.context_width, self.arrivals,
                            self.short_tokens, tree, out)
        if self.routes.prefill:
            prefill_attention(q, kc, vc, batch.token_rows, batch.positions, batch.seq_lens, batch.block_tables,
                              batch.block_size, self.query_start, self.routes.prefill, out)
        return out
