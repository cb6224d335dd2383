"""Triton flash attention for long query chunks (prefill) over paged or slotted KV storage, read in place.

No gathered copy, no [B, T, S] mask: the token at position p of row b sees positions < min(p + 1, seq_lens[b]).
One program serves BLOCK_M consecutive queries of one head of one row, online float32 softmax over BLOCK_N key
tiles (masked tiles skipped, only diagonal tiles masked); loop bounds come from device memory (CUDA-graph safe).
head_dim is padded to a power of two (>= 16) with masked loads."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from infer.transfer import to_device

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, m_i, l_i, q, K, V, BT, table, BS, kv_off, start, hi, qp, qk_scale, s_kr,
          d, d_ok, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One key tile [start, start + BLOCK_N) folded into the running (acc, m_i, l_i)."""
    offs = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
    valid = offs < hi
    block = tl.load(BT + table + offs // BS, mask=valid, other=0).to(tl.int64)
    rows = block * BS + offs % BS
    kv_mask = valid[:, None] & d_ok[None, :]
    ptr = rows[:, None] * s_kr + kv_off + d[None, :]  # [BLOCK_N, D_PAD]
    k = tl.load(K + ptr, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(V + ptr, mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE:  # float32: exact float32 products, not tf32
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:  # the diagonal: key j visible to query p iff j <= p and j < ctx_end (hi <= ctx_end)
        see = (offs[None, :] <= qp[:, None]) & valid[None, :]
        s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["s_bt", "BS"])
def _prefill_attention(Q, K, V, TILE_TOKEN, TILE_END, TOKEN_ROW, POS, SEQ_LEN, BT, OUT, qk_scale,
                       s_qn, s_qh, s_kr, s_kh, s_bt, BS, s_on, s_oh, GROUP: tl.constexpr, D: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last (longest-context) tiles first
    first = tl.load(TILE_TOKEN + tile).to(tl.int64)
    row = tl.load(TOKEN_ROW + first).to(tl.int64)
    kv_head = head // GROUP
    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] the tile's tokens
    m_ok = offs_m < tl.load(TILE_END + tile)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    qp = tl.load(POS + offs_m, mask=m_ok, other=0)  # [BLOCK_M] query positions
    seq_len = tl.load(SEQ_LEN + row)
    q = tl.load(Q + offs_m[:, None] * s_qn + head * s_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    # keys < hi may be visible to some query of the tile; keys < full to all of them
    hi = tl.minimum(tl.max(tl.where(m_ok, qp, 0), axis=0) + 1, seq_len)
    full = tl.minimum(tl.min(tl.where(m_ok, qp, hi), axis=0) + 1, hi)
    full = (full // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = row * s_bt
    kv_off = kv_head * s_kh
    for start in range(0, full, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, BT, table, BS, kv_off, start, hi, qp, qk_scale,
                              s_kr, d, d_ok, BLOCK_N, False, IEEE)
    for start in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, BT, table, BS, kv_off, start, hi, qp, qk_scale,
                              s_kr, d, d_ok, BLOCK_N, True, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (no key at all: zeros)
    tl.store(OUT + offs_m[:, None] * s_on + head * s_oh + d[None, :], out.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def prefill_supported(head_dim: int) -> bool:
    """Whether the kernel serves this head size (any up to MAX_HEAD_DIM, padded to a power of two)."""
    return 1 <= head_dim <= MAX_HEAD_DIM


def block_plan(head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size (small tiles off the GPU)."""
    if device.type != "cuda":
        return 16, 16, 1, 1
    if triton.next_power_of_2(head_dim) <= 128:
        return 128, 64, 8, 3
    return 64, 32, 4, 2


def check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError naming the fix for queries [N, Hq, D] and caches the kernel cannot serve."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"prefill attention needs q [N, Hq, D] and caches [rows, Hkv, D] of one shape, got "
                         f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    hq, d = q.shape[1:]
    hkv = k_cache.shape[1]
    if k_cache.shape[2] != d or hq % hkv:
        raise ValueError(f"q's heads ({hq} of size {d}) must be a multiple of the cache's KV heads ({hkv} of size "
                         f"{k_cache.shape[2]}) with the same head size: pass one layer's caches")
    if not prefill_supported(d):
        raise ValueError(f"head_dim {d} is above the kernel's {MAX_HEAD_DIM}: use the gather + SDPA path")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the caches' head_dim must be contiguous and K and V strided alike: pass "
                         "k_cache[layer], v_cache[layer] of the pool's [layers, rows, Hkv, D] tensors")


def query_tiles(query_start: Sequence[int], rows: Sequence[int], block_m: int) -> tuple[list[int], list[int]]:
    """(first tokens, row end tokens) of the tiles of at most block_m consecutive tokens of `rows`."""
    first, end = [], []
    for b in rows:
        lo, hi = query_start[b], query_start[b + 1]
        for t in range(lo, hi, block_m):
            first.append(t)
            end.append(min(t + block_m, hi))
    return first, end


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_rows: torch.Tensor,
                      positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                      query_start: Sequence[int], rows: Sequence[int], out: torch.Tensor | None = None,
                      blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """Causal attention of the tokens of batch rows `rows` (their chunks) over their context.

    q: [N, Hq, D] rotated; k_cache, v_cache: [rows, Hkv, D] (this pass's K/V written); token_rows,
    positions: [N]; seq_lens: [B]; block_tables: [B, max_blocks]; query_start: host [B + 1].
    Writes those rows' tokens of `out` ([N, Hq, D], made when None) and returns it. `blocks`:
    (BLOCK_M, BLOCK_N) overriding `block_plan` (powers of two >= 16)."""
    check_caches(q, k_cache, v_cache)
    n, hq, d = q.shape
    block_m, block_n, warps, stages = block_plan(d, q.device)
    if blocks is not None:
        block_m, block_n = blocks
        if min(blocks) < 16 or any(x & (x - 1) for x in blocks):
            raise ValueError(f"blocks must be powers of two >= 16, got {blocks}")
    if out is None:
        out = torch.empty_like(q)
    first, end = query_tiles(query_start, rows, block_m)
    if not first:
        return out
    tiles = to_device(torch.tensor([first, end], dtype=torch.long), q.device)  # [2, tiles]
    if q.stride(2) != 1:
        q = q.contiguous()
    _prefill_attention[(hq, len(first))](
        q, k_cache, v_cache, tiles[0], tiles[1], token_rows, positions, seq_lens, block_tables, out,
        d ** -0.5 * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        block_size, out.stride(0), out.stride(1), GROUP=hq // k_cache.shape[1], D=d,
        D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages)
    return out

