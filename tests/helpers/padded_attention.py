"""The attention kernels over padded test cases: rows [B, T] of queries with each context
position's storage row (`gather_rows` [B, S]: block tables of one-position blocks), laid out
as the flat token lists the kernels read. The kernels' own tests build their cases this way;
the engine's passes are flat already (models/layers/paged_attention.py)."""

from __future__ import annotations

import torch

from infer.models.kernels.arrivals import ArrivalCounters


def rule_bits(rows: torch.Tensor) -> torch.Tensor:
    """A block rule's bool rows [..., T, W] (W < 64) -> int64 bit sets [..., T]: bit c set
    where query t sees block key c."""
    width = rows.shape[-1]
    assert width < 64, "one int64 word a token"
    weights = torch.ones(width, dtype=torch.long, device=rows.device) << torch.arange(width, device=rows.device)
    return (rows.long() * weights).sum(-1)


def _flat(q: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, t = q.shape[:2]
    token_rows = torch.arange(b, device=q.device).repeat_interleave(t)  # [B * T]
    return q.reshape(b * t, *q.shape[2:]).contiguous(), token_rows, q_pos.reshape(-1).contiguous()


def padded_split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           gather_rows: torch.Tensor, q_pos: torch.Tensor, ctx_end: torch.Tensor,
                           block: tuple[torch.Tensor, int, int] | None = None,
                           arrivals: ArrivalCounters | None = None) -> torch.Tensor:
    """The split-KV kernel: q [B, T, Hq, D]; q_pos [B, T]; ctx_end [B] -> [B, T, Hq, D].
    `block`: a tree's rule (bool rows [T, W] or [B, T, W], the block's first row within the
    chunk's block, W); `arrivals`: the kernel's counters (None: a fresh set)."""
    from infer.models.kernels.split_attention import split_attention
    b, t = q.shape[:2]
    flat, token_rows, positions = _flat(q, q_pos)
    tree = None
    if block is not None:
        rows, first_row, width = block
        base = (q_pos[:, :1] - first_row).expand(b, t).reshape(-1).contiguous()
        tree = (rule_bits(rows).expand(b, t).reshape(-1).contiguous(), base, width)
    query_start = torch.arange(b + 1, device=q.device) * t
    out = split_attention(flat, k_cache, v_cache, token_rows, query_start, positions, ctx_end.contiguous(),
                          gather_rows, 1, gather_rows.shape[1], arrivals or ArrivalCounters(q.device), tree=tree)
    return out.view(q.shape)


def padded_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             gather_rows: torch.Tensor, q_pos: torch.Tensor, ctx_end: torch.Tensor,
                             blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """The flash prefill kernel over the same inputs (its rows each a query row of T)."""
    from infer.models.kernels.prefill_attention import prefill_attention
    b, t = q.shape[:2]
    flat, token_rows, positions = _flat(q, q_pos)
    out = prefill_attention(flat, k_cache, v_cache, token_rows, positions, ctx_end.contiguous(),
                            gather_rows.contiguous(), 1, [i * t for i in range(b + 1)], range(b), blocks=blocks)
    return out.view(q.shape)
