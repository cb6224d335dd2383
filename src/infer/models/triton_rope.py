"""Rotary embedding and the KV cache write in one Triton kernel.

A decode step's attention block otherwise launches the rotary of q and k (and the cos/sin
tables it reads) and two scatter copies of k and v into the cache, per layer. Here one
program per (token, head) reads its head of the fused qkv projection output, rotates it
with cos/sin of the token's position computed in place (float32, rounded to the model's
dtype as Hugging Face's tables are), and writes a q head to the rotated-q output or a k
head (rotated) and its v head to the cache rows of the token (`write_rows`, the view's
indices: padding rows go to the pool's scratch row).

Roundings follow the eager path: q * cos and rotate_half(q) * sin are each rounded to the
model's dtype before their sum, as PyTorch computes them in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kernel(QKV, POS, INV_FREQ, QOUT, KC, VC, ROWS, s_tok, s_qt, s_kr, s_kh,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads (each also carries its v head)
    ty = QKV.dtype.element_ty
    d = tl.arange(0, HALF)
    pos = tl.load(POS + tok).to(tl.float32)
    freq = pos * tl.load(INV_FREQ + d)
    cos = tl.cos(freq).to(ty).to(tl.float32)
    sin = tl.sin(freq).to(ty).to(tl.float32)
    base = QKV + tok * s_tok + head * D
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    # [x1, x2] * cos + [-x2, x1] * sin, each product rounded as in the eager path
    out1 = ((x1 * cos).to(ty).to(tl.float32) + (-x2 * sin).to(ty).to(tl.float32)).to(ty)
    out2 = ((x2 * cos).to(ty).to(tl.float32) + (x1 * sin).to(ty).to(tl.float32)).to(ty)
    if head < HQ:
        dst = QOUT + tok * s_qt + head * D
        tl.store(dst + d, out1)
        tl.store(dst + HALF + d, out2)
    else:
        kv = head - HQ
        row = tl.load(ROWS + tok).to(tl.int64)
        kdst = KC + row * s_kr + kv * s_kh
        tl.store(kdst + d, out1.to(KC.dtype.element_ty))
        tl.store(kdst + HALF + d, out2.to(KC.dtype.element_ty))
        vsrc = QKV + tok * s_tok + (HQ + HKV + kv) * D
        vdst = VC + row * s_kr + kv * s_kh
        tl.store(vdst + d, tl.load(vsrc + d).to(VC.dtype.element_ty))
        tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d).to(VC.dtype.element_ty))


def rope_write(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, heads: int, kv_heads: int,
               k_cache: torch.Tensor, v_cache: torch.Tensor, write_rows: torch.Tensor) -> torch.Tensor:
    """qkv: [B, T, (heads + 2 kv_heads) * D] (rows contiguous); positions: [B, T] long;
    inv_freq: [D / 2] float32; k_cache, v_cache: [rows, kv_heads, D] (one layer);
    write_rows: [B * T] long. Writes rotated k and v into the caches and returns rotated q
    [B, T, heads, D]."""
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    flat = qkv.reshape(b * t, width)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    q = torch.empty((b, t, heads, d), dtype=qkv.dtype, device=qkv.device)
    _rope_write_kernel[(b * t, heads + kv_heads)](
        flat, positions.reshape(-1).contiguous(), inv_freq, q, k_cache, v_cache, write_rows,
        flat.stride(0), heads * d, k_cache.stride(0), k_cache.stride(1),
        HQ=heads, HKV=kv_heads, D=d, HALF=d // 2, num_warps=1)
    return q
