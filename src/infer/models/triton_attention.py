"""Triton attention for short query chunks over row-indexed (paged or slotted) KV storage.

Decode (1 token), draft steps and speculative verification (K+1 tokens) attend over the
cached context directly through `gather_rows` (the storage row of every context position),
so the context is never copied out, and only positions < min(q_pos + 1, ctx_end) are read:
the loop bound comes from device memory, so one CUDA graph serves any context length.
One program per (batch row, KV head, query token) handles all query heads of its group
(grouped-query attention) with an online softmax in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# T (the chunk width) and the row stride vary from call to call (verification widths, the
# draft's catch-up chunks, eager context widths): runtime values, so one compiled kernel
# serves them all instead of a fresh Triton compile per width.
@triton.jit(do_not_specialize=["T", "s_rb"])
def _chunk_attention(Q, K, V, ROWS, QPOS, CTX_END, OUT, scale,
                     s_qb, s_qt, s_qh, s_kr, s_kh, s_rb, s_ob, s_ot, s_oh,
                     T, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    t = tl.program_id(2)
    q_pos = tl.load(QPOS + b * T + t)
    end = tl.minimum(q_pos + 1, tl.load(CTX_END + b))
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(Q + b * s_qb + t * s_qt + heads[:, None] * s_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)  # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for start in range(0, end, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs < end
        rows = tl.load(ROWS + b * s_rb + offs, mask=valid, other=0).to(tl.int64)
        k = tl.load(K + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:  # float32 caches: exact float32 products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + b * s_ob + t * s_ot + heads[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=(g < GROUP)[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           gather_rows: torch.Tensor, q_pos: torch.Tensor, ctx_end: torch.Tensor) -> torch.Tensor:
    """q: [B, T, Hq, D]; k_cache, v_cache: [rows, Hkv, D] (one layer); gather_rows: [B, S];
    q_pos: [B, T]; ctx_end: [B] -> [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    q_pos = q_pos.contiguous()
    grid = (b, hkv, t)
    _chunk_attention[grid](
        q, k_cache, v_cache, gather_rows, q_pos, ctx_end, out, d ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), gather_rows.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        T=t, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=64,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )
    return out
