"""Rotary embedding and the KV-cache write in one Triton kernel, for the fused decode path.

One program per (token, head) of the fused qkv output: a query head is rotated and stored, a key
head rotated and stored with its value head to the token's cache row. Roundings follow
`rotary.rotate` (each product rounded to the activation dtype, then their sum; no floating-point
contraction), so the result is bit-identical to the eager rotary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src, d, partner, lower, inside, c, s):
    """One head of D values at `src`: x * cos + rotate_half(x) * sin, eager roundings."""
    x = tl.load(src + d, mask=inside, other=0.0)
    ty = x.dtype
    xr = tl.load(src + partner, mask=inside, other=0.0).to(tl.float32)
    rot = tl.where(lower, -xr, xr)  # rotate_half: [-x2, x1] (exact in float32, as in x's dtype)
    a = (x.to(tl.float32) * c).to(ty)
    b = (rot * s).to(ty)
    return (a.to(tl.float32) + b.to(tl.float32)).to(ty)


@triton.jit(do_not_specialize=["T"])
def _rotary_write_kernel(Q, K, V, COS, SIN, ROWS, QO, KC, VC, T, s_rows,
                         s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct, s_sb, s_st,
                         s_ob, s_ot, s_oh, s_cr, s_ch,
                         HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # query heads first, then key heads (each with its value head)
    b = tok // T
    t = tok % T
    d = tl.arange(0, D_PAD)
    inside = d < D
    lower = d < D // 2
    partner = tl.where(lower, d + D // 2, d - D // 2)
    c = tl.load(COS + b * s_cb + t * s_ct + d, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * s_sb + t * s_st + d, mask=inside, other=0.0).to(tl.float32)
    if head < HQ:
        out = _rotate(Q + b * s_qb + t * s_qt + head * s_qh, d, partner, lower, inside, c, s)
        tl.store(QO + b * s_ob + t * s_ot + head * s_oh + d, out, mask=inside)
    else:
        kv = head - HQ
        row = tl.load(ROWS + tok * s_rows).to(tl.int64)
        dst = row * s_cr + kv * s_ch + d
        out = _rotate(K + b * s_kb + t * s_kt + kv * s_kh, d, partner, lower, inside, c, s)
        tl.store(KC + dst, out.to(KC.dtype.element_ty), mask=inside)
        val = tl.load(V + b * s_vb + t * s_vt + kv * s_vh + d, mask=inside, other=0.0)
        tl.store(VC + dst, val.to(VC.dtype.element_ty), mask=inside)


def check_rotary_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, write_rows: torch.Tensor) -> None:
    """Raise a ValueError naming what to fix for inputs the kernel cannot take."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rotary_kv_write takes q [B, T, Hq, D] and k, v [B, T, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, t, _, dim = q.shape
    if dim % 2:
        raise ValueError(f"the rotary needs an even head_dim, got {dim}")
    if any(x.stride(3) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v must be contiguous along head_dim (views of the qkv output are)")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (b, t, 1, dim) or table.stride(3) != 1:
            raise ValueError(f"{name} must be [B={b}, T={t}, 1, D={dim}] contiguous along D, got {tuple(table.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != tuple(k.shape[2:]):
        raise ValueError(f"k_cache and v_cache must be one layer's [rows, Hkv={k.shape[2]}, D={dim}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("k_cache and v_cache must share strides, contiguous along head_dim")
    if write_rows.shape != (b * t,) or write_rows.dtype != torch.long:
        raise ValueError(f"write_rows must be a long tensor [B * T = {b * t}], got {write_rows.dtype} "
                         f"{tuple(write_rows.shape)}")


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
    """Rotate q and k, write the rotated k and v into the cache rows; return the rotated q.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (D contiguous); cos, sin: [B, T, 1, D] in q's dtype;
    k_cache, v_cache: [rows, Hkv, D]; write_rows: [B * T] long (any stride). Returns q contiguous."""
    check_rotary_inputs(q, k, v, cos, sin, k_cache, v_cache, write_rows)
    b, t, hq, dim = q.shape
    out = torch.empty((b, t, hq, dim), dtype=q.dtype, device=q.device)  # [B, T, Hq, D]
    _rotary_write_kernel[(b * t, hq + k.shape[2])](
        q, k, v, cos, sin, write_rows, out, k_cache, v_cache, t, write_rows.stride(0),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        out.stride(0), out.stride(1), out.stride(2), k_cache.stride(0), k_cache.stride(1),
        HQ=hq, D=dim, D_PAD=triton.next_power_of_2(dim), num_warps=1, enable_fp_fusion=False)
    return out
