"""Few-row matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T for M = 1..MAX_ROWS rows, bound by
reading W once.

W is bf16/fp16 (x's dtype), FP8 E4M3 with a float32 scale per output row (applied in the
epilogue), or integer codes with a scale and an offset per group (layers/int_quant.py),
unpacked in registers. Each program streams `block_n` rows of W along K with every row of x
riding along; its inner product is float32 FMA ("fma": a row tile of M rounded up to a power
of two) or `tl.dot` on 16-row tiles ("dot"). K may be split over `split_k` programs whose
float32 partial sums a second kernel adds in a fixed order. Fused, each a flag of `gemv`: the
RMSNorm prologue (`norm_weight`), the SwiGLU prologue (`swiglu_input`: x is gate | up) and the
residual epilogue (`residual`), each rounding as the eager kernels do. Launch parameters
come from `gemv_tiles.config_for`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.models.kernels.gemv_tiles import GemvConfig, check_inputs, config_for, logical_shape, row_bucket, weight_kind
from infer.models.layers.int_quant import IntScales

_REDUCE_BLOCK_N = 64  # columns per program of the split-K reduction


@triton.jit
def _epilogue(acc, Y, S, R, rm, rn, M, N, s_ym, s_rm, SCALED: tl.constexpr, RESIDUAL: tl.constexpr):
    """acc [BM, BN] float32 -> scaled, rounded to Y's dtype, plus the residual, stored."""
    out_ty = Y.dtype.element_ty
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SCALED:
        acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
    out = acc.to(out_ty)
    if RESIDUAL:
        r = tl.load(R + rm[:, None] * s_rm + rn[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(Y + rm[:, None] * s_ym + rn[None, :], out, mask=mask)


@triton.jit
def _load_input(X, NW, rm, kk, rstd, M, K, s_xm, NORM: tl.constexpr, SWIGLU: tl.constexpr):
    """The [BM, BK] tile of the matmul's input at columns kk, prologues applied, in X's dtype."""
    mask = (rm[:, None] < M) & (kk[None, :] < K)
    ptrs = X + rm[:, None] * s_xm + kk[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    ty = x.dtype
    if SWIGLU:  # X holds [gate | up], each K wide
        g = x.to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        silu = (g / (1.0 + tl.exp(-g))).to(ty)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(ty)
    if NORM:
        normed = (x.to(tl.float32) * rstd[:, None]).to(ty)
        nw = tl.load(NW + kk, mask=kk < K, other=0.0)
        x = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(ty)
    return x


@triton.jit
def _group_values(T, rn, kk, k0, N, G, BN: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr,
                  GROUP: tl.constexpr):
    """A per-group tensor T [N, G] (scales or offsets) spread over the weight tile [BN, BKW]
    whose columns kk span BK columns of K from k0 (a multiple of BK): one value a row when
    the tile lies in one group, a [BN, BK / GROUP] tile broadcast over each group's columns
    when groups tile it, else gathered column by column."""
    if GROUP % BK == 0:
        v = tl.load(T + rn * G + k0 // GROUP, mask=rn < N, other=0.0).to(tl.float32)
        return v[:, None]
    elif BK % GROUP == 0:
        gi = k0 // GROUP + tl.arange(0, BK // GROUP)
        v = tl.load(T + rn[:, None] * G + gi[None, :], mask=(rn[:, None] < N) & (gi[None, :] < G),
                    other=0.0).to(tl.float32)  # [BN, BK / GROUP]
        return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, BK // GROUP, BKW * GROUP // BK)), (BN, BKW))
    else:
        mask = (rn[:, None] < N) & (kk[None, :] < G * GROUP)
        return tl.load(T + rn[:, None] * G + (kk // GROUP)[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _int_weights(W, GS, GO, rn, kk, k0, k_hi, N, s_wn, G, BITS: tl.constexpr, GROUP: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr):
    """Dequantized float32 weights [BN, BKW] of integer codes for the BK columns from k0 (kk:
    8-bit codes' columns; 4-bit: the even columns, whose byte also holds kk + 1): s * q + o;
    4-bit returns the odd columns' weights second (8-bit: the same weights again, unused).
    One return of one type: the compiler types every return of a function alike."""
    mask = (rn[:, None] < N) & (kk[None, :] < k_hi)
    s = _group_values(GS, rn, kk, k0, N, G, BN, BK, BKW, GROUP)
    o = _group_values(GO, rn, kk, k0, N, G, BN, BK, BKW, GROUP)
    if BITS == 4:
        b = tl.load(W + rn[:, None] * s_wn + (kk // 2)[None, :], mask=mask, other=0)
        lo = (b & 15).to(tl.float32) * s + o
        hi = (b >> 4).to(tl.float32) * s + o
    else:
        b = tl.load(W + rn[:, None] * s_wn + kk[None, :], mask=mask, other=0)
        lo = b.to(tl.float32) * s + o
        hi = lo
    return lo, hi


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, S, GS, GO, NW, R, Y, P, M, N, K, G, K_PER_SPLIT, s_xm, s_wn, s_rm, s_ym, eps,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, FP8: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr,
                 SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, PARTIAL: tl.constexpr, STAGES: tl.constexpr,
                 NORM_BK: tl.constexpr, BKW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BKW)  # BKW = BK, or BK / 2 for 4-bit codes (the even columns)
    rstd = tl.zeros((BM,), tl.float32)
    if NORM:  # every program recomputes its rows' RMS over all of K, in few wide steps
        rq = tl.arange(0, NORM_BK)
        sq = tl.zeros((BM, NORM_BK), tl.float32)
        for k0 in range(0, K, NORM_BK):
            kq = k0 + rq
            xs = tl.load(X + rm[:, None] * s_xm + kq[None, :], mask=(rm[:, None] < M) & (kq[None, :] < K),
                         other=0.0).to(tl.float32)
            sq += xs * xs
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    w_rows = W + rn[:, None] * s_wn
    if DOT:
        acc = tl.zeros((BM, BN), tl.float32)
    else:
        acc3 = tl.zeros((BM, BN, BKW), tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        if BITS == 4:
            kk = k0 + 2 * rk
            w, w_odd = _int_weights(W, GS, GO, rn, kk, k0, k_hi, N, s_wn, G, BITS, GROUP, BN, BK, BKW)
            x = _load_input(X, NW, rm, kk, rstd, M, K, s_xm, NORM, SWIGLU)
            x_odd = _load_input(X, NW, rm, kk + 1, rstd, M, K, s_xm, NORM, SWIGLU)
            if DOT:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
                acc = tl.dot(x_odd, tl.trans(w_odd.to(x.dtype)), acc)
            else:
                acc3 += x.to(tl.float32)[:, None, :] * w[None, :, :]
                acc3 += x_odd.to(tl.float32)[:, None, :] * w_odd[None, :, :]
        else:
            kk = k0 + rk
            x = _load_input(X, NW, rm, kk, rstd, M, K, s_xm, NORM, SWIGLU)
            if BITS == 8:
                w, _ = _int_weights(W, GS, GO, rn, kk, k0, k_hi, N, s_wn, G, BITS, GROUP, BN, BK, BKW)
            else:
                w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < k_hi), other=0.0)
            if DOT:
                if FP8:  # E4M3 -> fp16 converts natively; x's range fits fp16
                    acc = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
                else:
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
            else:
                acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=2)
    if PARTIAL:  # this split's float32 sums into P[pid_k, M, N]; the reduce kernel finishes
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(P + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
    else:
        _epilogue(acc, Y, S, R, rm, rn, M, N, s_ym, s_rm, SCALED, RESIDUAL)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(P, S, R, Y, M, N, s_rm, s_ym, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   SCALED: tl.constexpr, RESIDUAL: tl.constexpr):
    """Y = epilogue(sum over the SPLIT partials in index order) for BN columns."""
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(P + s * M * N + offs, mask=mask, other=0.0)
    _epilogue(acc, Y, S, R, rm, rn, M, N, s_ym, s_rm, SCALED, RESIDUAL)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | IntScales | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-5, swiglu_input: bool = False,
         residual: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """y [M, N] = prologue(x) @ W^T (* scale per row), rounded to x's dtype (+ residual).

    x: [M, K] (bf16/fp16, M in 1..16), or [M, 2K] gate | up with `swiglu_input`;
    w: [N, K] in x's dtype, float8_e4m3fn with `scale` [N] float32, or packed integer codes
    uint8 [N, K * bits / 8] with `scale` an `IntScales` (scales, offsets [N, K / group] in
    x's dtype); norm_weight: [K] in x's dtype: RMSNorm x first (eps as the model's
    rms_norm_eps); residual: [M, N] in x's dtype, added after rounding. `config` overrides
    `config_for`.
    """
    check_inputs(x, w, scale, norm_weight, swiglu_input, residual)
    m = x.shape[0]
    n, k = logical_shape(w, scale)
    kind = weight_kind(w, scale)
    ints = scale if isinstance(scale, IntScales) else None
    cfg = config if config is not None else config_for(n, k, m, kind)
    bits = ints.layout.bits if ints is not None else 0
    if bits == 4 and cfg.block_k < 32:
        raise ValueError(f"4-bit weights need GemvConfig.block_k >= 32, got {cfg.block_k}")
    bm = 16 if cfg.dot else row_bucket(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    partial = cfg.split_k > 1
    p = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if partial else y  # [S, M, N]
    s = scale if isinstance(scale, torch.Tensor) else y
    gs, go = (ints.scales, ints.offsets) if ints is not None else (y, y)
    nw = norm_weight if norm_weight is not None else y
    r = residual if residual is not None else y
    flags = dict(SCALED=isinstance(scale, torch.Tensor), RESIDUAL=residual is not None)
    # the RMS pass reads x in steps of up to 8192 values a program (all of K in one or two
    # steps for one or two rows), so that few dependent loads precede the matmul
    norm_bk = min(triton.next_power_of_2(k), max(cfg.block_k, 8192 // bm)) if norm_weight is not None else 16
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x, w, s, gs, go, nw, r, y, p, m, n, k, gs.shape[1] if ints is not None else 1, k_per_split, x.stride(0),
        w.stride(0), r.stride(0), y.stride(0), eps,
        BM=bm, BN=cfg.block_n, BK=cfg.block_k, DOT=cfg.dot, FP8=kind == "fp8", BITS=bits,
        GROUP=ints.layout.group_size if ints is not None else 1, NORM=norm_weight is not None,
        SWIGLU=swiglu_input, PARTIAL=partial, STAGES=cfg.num_stages, NORM_BK=norm_bk,
        BKW=cfg.block_k // 2 if bits == 4 else cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **(flags if not partial else dict(SCALED=False, RESIDUAL=False)))
    if partial:
        _reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK_N),)](
            p, s, r, y, m, n, r.stride(0), y.stride(0), SPLIT=cfg.split_k, BM=row_bucket(m),
            BN=_REDUCE_BLOCK_N, num_warps=4, **flags)
    return y
