"""Triton attention for short query chunks over row-indexed (paged or slotted) KV storage.

Decode (1 token), draft steps and speculative verification (K+1 tokens) attend over the
cached context directly through `gather_rows` (the storage row of every context position),
so the context is never copied out, and only positions < min(q_pos + 1, ctx_end) are read:
the loop bounds come from device memory, so one CUDA graph serves any context length.

The context is split into chunks (flash-decoding): one program per (batch row, KV head,
query token, chunk) handles all query heads of its group (grouped-query attention) with an
online softmax in float32 and writes its partial result (running max, sum, unnormalised
output); the last of a (row, KV head, token)'s programs to finish (an arrival counter,
atomically incremented, which that program resets) combines the chunks, so a layer's
attention is one launch. A decode step at batch 1
then runs tens of programs per layer instead of one per KV head, each a short loop: the
chain of dependent loads (row index, key, value) of a long serial loop is what bounded it.
The number of chunks follows the gather width and the programs the batch already brings
(`split_plan`; both fixed per CUDA graph): a few rows get up to MAX_SPLITS chunks, chunks
past a row's context ending at once; a large batch (its rows x KV heads x tokens filling
the GPU on their own) gets fewer, down to one, whose program writes its output directly
(no partials, no combine: sixteen 64-position chunks a row would write and re-read float32
partials about a fifth the size of the KV they cover).

Tree verification adds a block rule (`cache.view.BlockMask`): inside the W positions of the
tree's block, query t sees key c only where its ancestor bit c is set. The rule comes as
one int64 bit set per query (`block_bits`: [T] for a static tree, [B, T] per row for dynamic
trees, W <= MAX_BLOCK), so the kernel masks those keys as it streams them, without a
[B, T, S] mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16
MIN_CHUNK = 64
TARGET_PROGRAMS = 1024  # programs a launch aims for: at most as many chunks as it takes
MAX_BLOCK = 63  # widest tree block as int64 bit sets (bit 63 would be the sign)
MIN_COUNTERS = 1 << 18  # arrival counters allocated at first use, so that a capture rarely allocates


@triton.jit(do_not_specialize=["T", "s_rb", "s_bb", "s_bt", "FIRST_ROW", "WIDTH"])
def _split_attention(Q, K, V, ROWS, QPOS, CTX_END, BITS, M_OUT, L_OUT, A_OUT, ARRIVED, OUT, scale,
                     s_qb, s_qt, s_qh, s_kr, s_kh, s_rb, s_bb, s_bt, FIRST_ROW, WIDTH, s_ob, s_ot, s_oh,
                     T, HQ: tl.constexpr, HKV: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                     GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     IEEE: tl.constexpr, HAS_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    t = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_pos = tl.load(QPOS + b * T + t)
    end = tl.minimum(q_pos + 1, tl.load(CTX_END + b))
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, end)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(Q + b * s_qb + t * s_qt + heads[:, None] * s_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)  # [G_PAD, D]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if HAS_BLOCK:
        bits = tl.load(BITS + b * s_bb + t * s_bt)  # int64: the block keys query t sees
        base = tl.load(QPOS + b * T) - FIRST_ROW  # the block's first position in this row
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs < hi
        if HAS_BLOCK:
            rel = offs - base
            inside = (rel >= 0) & (rel < WIDTH)
            seen = ((bits >> tl.where(inside, rel, 0).to(tl.int64)) & 1) != 0
            valid = valid & (seen | ~inside)
        rows = tl.load(ROWS + b * s_rb + offs, mask=valid, other=0).to(tl.int64)
        k = tl.load(K + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:  # float32 caches: exact float32 products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a tile whose keys are all masked so far leaves m at -inf: exponents against 0 then
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    keep = g < GROUP
    if SPLITS == 1:  # the whole context in this program: normalise and store
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + b * s_ob + t * s_ot + heads[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=keep[:, None])
    else:
        _combine_partials(M_OUT, L_OUT, A_OUT, ARRIVED, OUT, m_i, l_i, acc, b, t, kv_head, split, heads, g, d, keep,
                          s_ob, s_ot, s_oh, T, HQ, HKV, SPLITS, G_PAD, D)


@triton.jit
def _combine_partials(M_OUT, L_OUT, A_OUT, ARRIVED, OUT, m_i, l_i, acc, b, t, kv_head, split, heads, g, d, keep,
                      s_ob, s_ot, s_oh, T, HQ: tl.constexpr, HKV: tl.constexpr, SPLITS: tl.constexpr,
                      G_PAD: tl.constexpr, D: tl.constexpr):
    # partials of (b, t, head, split): an empty chunk leaves m = -inf, l = 0
    cell = ((b * T + t) * HQ + heads) * SPLITS + split  # [G_PAD]
    tl.store(M_OUT + cell, m_i, mask=keep)
    tl.store(L_OUT + cell, l_i, mask=keep)
    tl.store(A_OUT + cell[:, None] * D + d[None, :], acc, mask=keep[:, None])
    # the last program of (b, kv_head, t) to arrive combines every chunk's partials: the
    # release orders this program's stores before its arrival, the acquire the others' before
    # the loads below (which bypass L1: `.cg`)
    tl.debug_barrier()
    counter = ARRIVED + (b * T + t) * HKV + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
        sp = tl.arange(0, SPLITS)
        cells = ((b * T + t) * HQ + heads)[:, None] * SPLITS + sp[None, :]  # [G_PAD, SPLITS]
        m = tl.load(M_OUT + cells, mask=keep[:, None], other=float("-inf"), cache_modifier=".cg")
        l = tl.load(L_OUT + cells, mask=keep[:, None], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, axis=1)  # [G_PAD]
        w = tl.where(l > 0, tl.exp(m - m_max[:, None]), 0.0)  # an empty chunk weighs nothing
        out = tl.zeros([G_PAD, D], tl.float32)
        for j in tl.static_range(SPLITS):
            w_j = tl.sum(tl.where(sp[None, :] == j, w, 0.0), axis=1)  # [G_PAD]
            a_j = tl.load(A_OUT + ((b * T + t) * HQ + heads)[:, None] * (SPLITS * D) + j * D + d[None, :],
                          mask=keep[:, None], other=0.0, cache_modifier=".cg")  # [G_PAD, D]
            out += a_j * w_j[:, None]
        out = out / tl.sum(l * w, axis=1)[:, None]
        tl.store(OUT + b * s_ob + t * s_ot + heads[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=keep[:, None])
        tl.atomic_xchg(counter, 0)  # ready for the next launch (a CUDA graph replays this one)


_ARRIVED: dict[tuple[str, int | None], list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros on `device` for the kernel's arrival counters (each launch leaves them
    at zero). Kept for the process: a captured CUDA graph holds their address, so a larger
    set is added, never swapped in."""
    kept = _ARRIVED.setdefault((device.type, device.index), [])
    if not kept or kept[-1].numel() < n:  # (1 MB first: batch 256 x 128 tokens x 8 KV heads)
        kept.append(torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device))
    return kept[-1]


def split_plan(context_width: int, programs: int) -> tuple[int, int]:
    """(chunk length, number of chunks) for a gather width and the (row, KV head, token)
    programs of a launch: as many chunks as bring the launch to TARGET_PROGRAMS, at most
    MAX_SPLITS, each at least MIN_CHUNK positions, a power of two long (one chunk: the
    whole width)."""
    wanted = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, programs))))
    if wanted == 1:
        return triton.next_power_of_2(context_width), 1
    chunk = max(MIN_CHUNK, triton.next_power_of_2(-(-context_width // wanted)))
    return chunk, triton.next_power_of_2(-(-context_width // chunk))


def block_bits(rows: torch.Tensor) -> torch.Tensor:
    """A block rule's bool rows [..., T, W] (W <= MAX_BLOCK) -> int64 bit sets [..., T]:
    bit c set where query t sees block key c."""
    width = rows.shape[-1]
    if width > MAX_BLOCK:
        raise ValueError(f"a tree block of {width} positions is wider than the kernel's {MAX_BLOCK}")
    weights = torch.ones(width, dtype=torch.long, device=rows.device) << torch.arange(width, device=rows.device)
    return (rows.long() * weights).sum(-1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           gather_rows: torch.Tensor, q_pos: torch.Tensor, ctx_end: torch.Tensor,
                           block: tuple[torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """q: [B, T, Hq, D]; k_cache, v_cache: [rows, Hkv, D] (one layer); gather_rows: [B, S];
    q_pos: [B, T]; ctx_end: [B] -> [B, T, Hq, D]. `block`: a tree's rule as (`block_bits`
    [T] or [B, T], the block's first row as in `BlockMask`, its width W)."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    q = q.contiguous()
    q_pos, ctx_end = q_pos.contiguous(), ctx_end.contiguous()
    chunk, splits = split_plan(gather_rows.shape[1], b * hkv * t)
    m = torch.empty((b, t, hq, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    a = torch.empty((b, t, hq, splits, d), dtype=torch.float32, device=q.device)
    bits, first_row, width = block if block is not None else (ctx_end, 0, 0)  # (bits unread without a block)
    s_bb, s_bt = (0, bits.stride(0)) if bits.dim() == 1 else (bits.stride(0), bits.stride(1))
    out = torch.empty_like(q)
    _split_attention[(b, hkv, t * splits)](
        q, k_cache, v_cache, gather_rows, q_pos, ctx_end, bits, m, l, a, arrival_counters(q.device, b * t * hkv), out,
        d ** -0.5, q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), gather_rows.stride(0),
        s_bb, s_bt, first_row, width, out.stride(0), out.stride(1), out.stride(2),
        T=t, HQ=hq, HKV=hkv, SPLITS=splits, CHUNK=chunk, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)),
        D=d, BLOCK_N=min(64, chunk), IEEE=q.dtype == torch.float32, HAS_BLOCK=block is not None, num_warps=4)
    return out
