"""Triton split-KV attention (flash-decoding) for short query chunks over paged or slotted KV storage.

Decode, draft steps, verification and tree blocks: each token attends to positions < min(position + 1, seq_lens[row])
through the block table, loop bounds read from device memory (one CUDA graph serves any context length). A program
per (run of a row's tokens, KV head, chunk) runs an online float32 softmax; the last to finish (arrivals.py) combines
the chunks. Tree blocks: an int64 ancestor bit set per token (W <= 64)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.models.kernels.arrivals import ArrivalCounters

MAX_SPLITS = 16
MIN_CHUNK = 64
TARGET_PROGRAMS = 1024  # programs a launch aims for: at most as many chunks as it takes
QUERY_TILE = 16  # query rows of a program's tile: a run of a row's tokens, each with its KV head's query heads


@triton.jit(do_not_specialize=["s_bt", "BS", "WIDTH"])
def _split_attention(Q, K, V, TOKENS, TOKEN_ROW, QSTART, POS, SEQ_LEN, BT, BITS, BASE, M_OUT, L_OUT, A_OUT, ARRIVED,
                     OUT, scale, s_qn, s_qh, s_kr, s_kh, s_bt, BS, WIDTH, s_on, s_oh,
                     HQ: tl.constexpr, HKV: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                     GROUP: tl.constexpr, QT: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_TOKENS: tl.constexpr, HAS_TREE: tl.constexpr):
    j = tl.program_id(0)  # this launch's j-th token: TOKENS[j], or token j
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    i = tl.load(TOKENS + j).to(tl.int64) if HAS_TOKENS else j.to(tl.int64)
    row = tl.load(TOKEN_ROW + i).to(tl.int64)
    first = tl.load(QSTART + row)
    stop = tl.load(QSTART + row + 1)
    in_row = (i >= first) & (i < stop)  # (a padding token lies past its row's tokens: it is its own run)
    leads = ~in_row | ((i - first) % QT == 0)
    count = tl.where(in_row, tl.minimum(stop - i, QT), 1)  # the run's tokens: i .. i + count - 1
    if leads:
        r = tl.arange(0, M)  # tile row r: the run's token r // GROUP, its group's query head r % GROUP
        t = r // GROUP
        keep = t < count
        lane_j = j + t  # (a run's tokens are consecutive in the launch's list too)
        lane_i = i + t
        heads = kv_head * GROUP + r % GROUP
        d = tl.arange(0, D)
        q = tl.load(Q + lane_i[:, None] * s_qn + heads[:, None] * s_qh + d[None, :], mask=keep[:, None],
                    other=0.0)  # [M, D]
        ends = tl.minimum(tl.load(POS + lane_i, mask=keep, other=-1) + 1, tl.load(SEQ_LEN + row))  # [M]
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, tl.max(ends, axis=0))
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        if HAS_TREE:
            bits = tl.load(BITS + lane_i, mask=keep, other=0)  # int64: the block keys each token sees
            base = tl.load(BASE + lane_i, mask=keep, other=0)  # the first position of its tree block
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            loaded = offs < hi
            seen = offs[None, :] < ends[:, None]  # [M, BLOCK_N]
            if HAS_TREE:
                rel = offs[None, :] - base[:, None]
                inside = (rel >= 0) & (rel < WIDTH)
                ancestor = ((bits[:, None] >> tl.where(inside, rel, 0).to(tl.int64)) & 1) != 0
                seen = seen & (ancestor | ~inside)
            block = tl.load(BT + row * s_bt + offs // BS, mask=loaded, other=0).to(tl.int64)
            rows = block * BS + offs % BS
            k = tl.load(K + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=loaded[:, None], other=0.0)
            v = tl.load(V + rows[:, None] * s_kr + kv_head * s_kh + d[None, :], mask=loaded[:, None], other=0.0)
            if IEEE:  # float32 caches: exact float32 products, not tf32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(seen, s, float("-inf"))
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
        if SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(OUT + lane_i[:, None] * s_on + heads[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
                     mask=keep[:, None])
        else:
            _combine_partials(M_OUT, L_OUT, A_OUT, ARRIVED, OUT, m_i, l_i, acc, j, lane_j, lane_i, kv_head, split,
                              heads, d, keep, s_on, s_oh, HQ, HKV, SPLITS, M, D)


@triton.jit
def _combine_partials(M_OUT, L_OUT, A_OUT, ARRIVED, OUT, m_i, l_i, acc, j, lane_j, lane_i, kv_head, split, heads, d,
                      keep, s_on, s_oh, HQ: tl.constexpr, HKV: tl.constexpr, SPLITS: tl.constexpr,
                      M: tl.constexpr, D: tl.constexpr):
    # partials of (launch token, head, split) for each tile row: an empty chunk leaves m = -inf, l = 0
    cell = (lane_j * HQ + heads) * SPLITS + split  # [M]
    tl.store(M_OUT + cell, m_i, mask=keep)
    tl.store(L_OUT + cell, l_i, mask=keep)
    tl.store(A_OUT + cell[:, None] * D + d[None, :], acc, mask=keep[:, None])
    # the last program of (run j, kv_head) to arrive combines the partials: acq_rel orders every
    # program's stores before the loads below (which bypass L1: `.cg`)
    tl.debug_barrier()
    counter = ARRIVED + j * HKV + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
        sp = tl.arange(0, SPLITS)
        cells = (lane_j * HQ + heads)[:, None] * SPLITS + sp[None, :]  # [M, SPLITS]
        m = tl.load(M_OUT + cells, mask=keep[:, None], other=float("-inf"), cache_modifier=".cg")
        l = tl.load(L_OUT + cells, mask=keep[:, None], other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, axis=1)  # [M]
        w = tl.where(l > 0, tl.exp(m - m_max[:, None]), 0.0)  # an empty chunk weighs nothing
        out = tl.zeros([M, D], tl.float32)
        for c in tl.static_range(SPLITS):
            w_c = tl.sum(tl.where(sp[None, :] == c, w, 0.0), axis=1)  # [M]
            a_c = tl.load(A_OUT + (lane_j * HQ + heads)[:, None] * (SPLITS * D) + c * D + d[None, :],
                          mask=keep[:, None], other=0.0, cache_modifier=".cg")  # [M, D]
            out += a_c * w_c[:, None]
        out = out / tl.where(keep, tl.sum(l * w, axis=1), 1.0)[:, None]
        tl.store(OUT + lane_i[:, None] * s_on + heads[:, None] * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=keep[:, None])
        tl.atomic_xchg(counter, 0)  # ready for the next launch (a CUDA graph replays this one)


def split_plan(context_width: int, programs: int) -> tuple[int, int]:
    """(chunk length, number of chunks) for a context width and a launch's programs: enough chunks
    to reach TARGET_PROGRAMS, at most MAX_SPLITS, each a power of two >= MIN_CHUNK long."""
    wanted = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(1, programs))))
    if wanted == 1:
        return triton.next_power_of_2(context_width), 1
    chunk = max(MIN_CHUNK, triton.next_power_of_2(-(-context_width // wanted)))
    return chunk, triton.next_power_of_2(-(-context_width // chunk))


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_rows: torch.Tensor,
                    query_start: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int, context_width: int, arrivals: ArrivalCounters,
                    tokens: torch.Tensor | None = None, tree: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of flat queries over paged storage.

    q: [N, Hq, D] rotated; k_cache, v_cache: [rows, Hkv, D] (this pass's keys written);
    token_rows, positions: [N]; query_start: [B + 1] (a token outside its row's range is padding);
    seq_lens: [B]; block_tables: [B, max_blocks]; context_width: a bound on seq_lens; tokens: [Nd]
    the tokens to compute, whole rows in order (None: all); tree: (bits [N], base [N], width) int64.
    Writes the computed tokens' rows of `out` ([N, Hq, D], made when None) and returns it."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    nd = n if tokens is None else tokens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if nd == 0:
        return out
    chunk, splits = split_plan(context_width, nd * hkv)
    m = torch.empty((nd, hq, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    a = torch.empty((nd, hq, splits, d), dtype=torch.float32, device=q.device)
    bits, base, width = tree if tree is not None else (positions, positions, 0)  # (unread without a tree)
    run = run_tokens(group)
    _split_attention[(nd, hkv, splits)](
        q, k_cache, v_cache, positions if tokens is None else tokens, token_rows, query_start, positions, seq_lens,
        block_tables, bits, base, m, l, a, arrivals.take(nd * hkv), out, d ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), block_size, width,
        out.stride(0), out.stride(1),
        HQ=hq, HKV=hkv, SPLITS=splits, CHUNK=chunk, GROUP=group, QT=run,
        M=max(QUERY_TILE, triton.next_power_of_2(run * group)), D=d, BLOCK_N=min(64, chunk),
        IEEE=q.dtype == torch.float32, HAS_TOKENS=tokens is not None, HAS_TREE=tree is not None, num_warps=4,
        num_stages=pipeline_stages(splits))
    return out


def pipeline_stages(splits: int) -> int:
    """Key / value tiles in flight a program: 1 at MAX_SPLITS (short loops), else 2."""
    return 1 if splits >= MAX_SPLITS else 2


def run_tokens(group: int) -> int:
    """Consecutive tokens of a row one program computes: enough to fill QUERY_TILE rows (at least one)."""
    return max(1, QUERY_TILE // group)
