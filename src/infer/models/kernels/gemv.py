"""Few-row matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T, M = 1..MAX_ROWS, reading W once.

W is bf16/fp16, FP8 E4M3 with a float32 scale per row, or integer group codes read as int32 words
(layers/int_quant.py). Each program streams `block_n` rows of W along K, by float32 FMA or `tl.dot` on 16-row
tiles; K may be split over `split_k` programs, whose partial sums the row block's last program (a counter it
resets) adds in a fixed order. Optional RMSNorm / SwiGLU prologues and residual epilogue round as eager does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.models.kernels.gemv_tiles import (GemvConfig, check_inputs, config_for, int_tile, logical_shape, row_bucket,
                                             weight_kind)
from infer.models.kernels.matmul_tiles import SplitWorkspace
from infer.models.layers.int_quant import IntScales

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
def _finish(acc, P, C, Y, S, R, rm, rn, pid_k, M, N, s_ym, s_rm, SCALED: tl.constexpr, RESIDUAL: tl.constexpr,
            SPLIT: tl.constexpr):
    """A program's float32 sums [BM, BN] through the epilogue into Y; with K split, into P[pid_k, M, N],
    and the row block's last program (counter C[pid_n]) sums the partials in index order and finishes."""
    if SPLIT == 1:
        _epilogue(acc, Y, S, R, rm, rn, M, N, s_ym, s_rm, SCALED, RESIDUAL)
    else:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]
        tl.store(P + pid_k * M * N + offs, acc, mask=mask)
        done = tl.atomic_add(C + tl.program_id(0), 1)  # acq_rel: the stores above are visible to the last
        if done == SPLIT - 1:
            acc = tl.zeros(acc.shape, tl.float32)
            for k in tl.static_range(SPLIT):
                acc += tl.load(P + k * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(C + tl.program_id(0), 0)
            _epilogue(acc, Y, S, R, rm, rn, M, N, s_ym, s_rm, SCALED, RESIDUAL)


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
def _row_rstd(X, rm, M, K, s_xm, eps, BM: tl.constexpr, NORM_BK: tl.constexpr):
    """1 / RMS of each of the BM rows of X over all of K (every program recomputes it)."""
    rq = tl.arange(0, NORM_BK)
    sq = tl.zeros((BM, NORM_BK), tl.float32)
    for k0 in range(0, K, NORM_BK):
        kq = k0 + rq
        xs = tl.load(X + rm[:, None] * s_xm + kq[None, :], mask=(rm[:, None] < M) & (kq[None, :] < K),
                     other=0.0).to(tl.float32)
        sq += xs * xs
    return tl.rsqrt(tl.sum(sq, axis=1) / K + eps)


@triton.jit
def _code_float(words, high, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """The code at bits SHIFT.. of each int32 word (from `high` = words >> 16 past bit 23), other bits
    cleared, bitcast to float32: exactly q * 2^(LOW - 149), LOW = SHIFT (or SHIFT - 16), since bits
    0-23 read linearly (the exponent's lowest bit continues the mantissa)."""
    if SHIFT + BITS <= 24:
        t = words & (((1 << BITS) - 1) << SHIFT)
    else:
        t = high & (((1 << BITS) - 1) << (SHIFT - 16))
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _code_term(acc, words, up, high, SHIFT: tl.constexpr, BITS: tl.constexpr, x, DOT: tl.constexpr):
    """acc + x @ (2^-14 q)^T for the codes q at bit SHIFT of words [BN, BW] (`up` = words << 8 for
    codes below bit 8, so the scale stays <= 2^127; 2^-14 q is exact and normal in fp16/bf16).
    x: [BM, BW]; acc: [BM, BN] (DOT), else [BM, BN, BW]."""
    if SHIFT < 8:
        w = _code_float(up, up, SHIFT + 8, BITS) * 2.0 ** (127 - SHIFT)
    elif SHIFT + BITS <= 24:
        w = _code_float(words, high, SHIFT, BITS) * 2.0 ** (135 - SHIFT)
    else:
        w = _code_float(words, high, SHIFT, BITS) * 2.0 ** (151 - SHIFT)
    if DOT:  # (if / else: the compiler would build a statement after a constexpr return too)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    else:
        acc = acc + x.to(tl.float32)[:, None, :] * w[None, :, :]
    return acc


@triton.jit
def _four_terms(acc, words, up, high, x4, BASE: tl.constexpr, STEP_A: tl.constexpr, STEP_B: tl.constexpr,
                BITS: tl.constexpr, DOT: tl.constexpr):
    """The terms of codes BASE + STEP_A * a + STEP_B * b of each word; x4 [BM, BW, 2, 2]: their x at [.., a, b]."""
    xb0, xb1 = tl.split(x4)
    x00, x10 = tl.split(xb0)
    x01, x11 = tl.split(xb1)
    acc = _code_term(acc, words, up, high, BITS * BASE, BITS, x00, DOT)
    acc = _code_term(acc, words, up, high, BITS * (BASE + STEP_A), BITS, x10, DOT)
    acc = _code_term(acc, words, up, high, BITS * (BASE + STEP_B), BITS, x01, DOT)
    return _code_term(acc, words, up, high, BITS * (BASE + STEP_A + STEP_B), BITS, x11, DOT)


@triton.jit(do_not_specialize=["M"])
def _int_gemv_kernel(X, W, GS, GO, NW, R, Y, P, C, M, N, K, G, K_PER_SPLIT, s_xm, s_wn, s_rm, s_ym, eps,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                     SPLIT: tl.constexpr, STAGES: tl.constexpr, NORM_BK: tl.constexpr):
    """Integer codes as int32 words W [N, K * BITS / 32] (code i of word j: column PER * j + i); a step
    covers BK columns of one group, scaled once; the offset enters as o * sum x."""
    PER: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BK // PER
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rj = tl.arange(0, BW)
    rk = tl.arange(0, BK)
    nmask = rn < N
    rstd = _row_rstd(X, rm, M, K, s_xm, eps, BM, NORM_BK) if NORM else tl.zeros((BM,), tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    if DOT:
        acc = tl.zeros((BM, BN), tl.float32)
    else:
        acc = tl.zeros((BM, BN, BW), tl.float32)
    acc_o = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        group = k0 // GROUP
        s = tl.load(GS + rn * G + group, mask=nmask, other=0.0).to(tl.float32) * 16384.0  # [BN], undoes 2^-14
        o = tl.load(GO + rn * G + group, mask=nmask, other=0.0).to(tl.float32)
        j0 = tl.multiple_of(k0 // PER, BW)  # (k0 is a multiple of BK)
        words = tl.load(W + rn[:, None] * s_wn + (j0 + rj)[None, :], mask=nmask[:, None], other=0)
        up, high = words << 8, words >> 16
        x = _load_input(X, NW, rm, k0 + rk, rstd, M, K, s_xm, NORM, SWIGLU)  # [BM, BK]
        acc_o += tl.sum(x.to(tl.float32), axis=1)[:, None] * o[None, :]
        if DOT:
            step = tl.zeros((BM, BN), tl.float32)
        else:
            step = tl.zeros((BM, BN, BW), tl.float32)
        if BITS == 4:  # x's column PER * j + i at [.., j, a, b, c] for i = 4a + 2b + c
            c0, c1 = tl.split(tl.reshape(x, (BM, BW, 2, 2, 2)))
            step = _four_terms(step, words, up, high, c0, 0, 4, 2, BITS, DOT)
            step = _four_terms(step, words, up, high, c1, 1, 4, 2, BITS, DOT)
        else:  # i = 2a + b
            step = _four_terms(step, words, up, high, tl.reshape(x, (BM, BW, 2, 2)), 0, 2, 1, BITS, DOT)
        if DOT:
            acc += step * s[None, :]
        else:
            acc += step * s[None, :, None]
    if not DOT:
        acc = tl.sum(acc, axis=2)
    acc += acc_o
    _finish(acc, P, C, Y, Y, R, rm, rn, pid_k, M, N, s_ym, s_rm, False, RESIDUAL, SPLIT)


@triton.jit
def _code_terms(acc, words, high, x, I: tl.constexpr, E: tl.constexpr):
    """acc + x q 2^-E for code I of each word, x [BW] float32, prescaled exactly to undo `_code_float`'s power."""
    LOW: tl.constexpr = 4 * I if 4 * I + 4 <= 24 else 4 * I - 16  # (`_code_float`'s rule)
    return acc + (x * 2.0 ** (149 - LOW - E))[None, :] * _code_float(words, high, 4 * I, 4)


@triton.jit(do_not_specialize=["M"])
def _int4_row_kernel(X, W, GS, GO, NW, R, Y, P, C, M, N, K, G, K_PER_SPLIT, s_xm, s_wn, s_rm, s_ym, eps,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, NORM: tl.constexpr,
                     SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
                     NORM_BK: tl.constexpr):
    """One row of x against 4-bit codes W [N, K / 8] int32 (code i of word j: column 8j + i), a group a
    step. Products carry 2^-E, undone with the scale (x up to 2^(128 - 149 + E) stays finite;
    products below 2^(E - 126) round as subnormals)."""
    BW: tl.constexpr = BK // 8
    E: tl.constexpr = 60
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, 1)
    rn = pid_n * BN + tl.arange(0, BN)
    rj = tl.arange(0, BW)
    rk = tl.arange(0, BK)
    nmask = rn < N
    rstd = _row_rstd(X, rm, M, K, s_xm, eps, 1, NORM_BK) if NORM else tl.zeros((1,), tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    total = tl.zeros((BN, BW), tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        group = k0 // GROUP
        s = tl.load(GS + rn * G + group, mask=nmask, other=0.0).to(tl.float32) * 2.0 ** E  # [BN]
        o = tl.load(GO + rn * G + group, mask=nmask, other=0.0).to(tl.float32)
        j0 = tl.multiple_of(k0 // 8, BW)  # (k0 is a multiple of BK)
        words = tl.load(W + rn[:, None] * s_wn + (j0 + rj)[None, :], mask=nmask[:, None], other=0)  # [BN, BW]
        high = words >> 16
        x = _load_input(X, NW, rm, k0 + rk, rstd, M, K, s_xm, NORM, SWIGLU).to(tl.float32)  # [1, BK]
        # x's column 8j + i as [BW] for each i, splitting pairs: 8j + 2c + {0, 1}, then c = 2d + {0, 1}, ...
        even, odd = tl.split(tl.reshape(x, (BW, 4, 2)))
        x04, x26 = tl.split(tl.reshape(even, (BW, 2, 2)))
        x15, x37 = tl.split(tl.reshape(odd, (BW, 2, 2)))
        x0, x4 = tl.split(x04)
        x2, x6 = tl.split(x26)
        x1, x5 = tl.split(x15)
        x3, x7 = tl.split(x37)
        acc = _code_terms(tl.zeros((BN, BW), tl.float32), words, high, x0, 0, E)
        acc = _code_terms(acc, words, high, x1, 1, E)
        acc = _code_terms(acc, words, high, x2, 2, E)
        acc = _code_terms(acc, words, high, x3, 3, E)
        acc = _code_terms(acc, words, high, x4, 4, E)
        acc = _code_terms(acc, words, high, x5, 5, E)
        acc = _code_terms(acc, words, high, x6, 6, E)
        acc = _code_terms(acc, words, high, x7, 7, E)
        xsum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7  # [BW]
        total += s[:, None] * acc + o[:, None] * xsum[None, :]
    acc_row = tl.sum(total, axis=1)[None, :]  # [1, BN]
    _finish(acc_row, P, C, Y, Y, R, rm, rn, pid_k, M, N, s_ym, s_rm, False, RESIDUAL, SPLIT)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, S, NW, R, Y, P, C, M, N, K, K_PER_SPLIT, s_xm, s_wn, s_rm, s_ym, eps,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, FP8: tl.constexpr,
                 SCALED: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                 SPLIT: tl.constexpr, STAGES: tl.constexpr, NORM_BK: tl.constexpr):
    """Half-precision or FP8 W [N, K]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rstd = _row_rstd(X, rm, M, K, s_xm, eps, BM, NORM_BK) if NORM else tl.zeros((BM,), tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(K, k_lo + K_PER_SPLIT)
    w_rows = W + rn[:, None] * s_wn
    if DOT:
        acc = tl.zeros((BM, BN), tl.float32)
    else:
        acc3 = tl.zeros((BM, BN, BK), tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kk = k0 + rk
        x = _load_input(X, NW, rm, kk, rstd, M, K, s_xm, NORM, SWIGLU)
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
    _finish(acc, P, C, Y, S, R, rm, rn, pid_k, M, N, s_ym, s_rm, SCALED, RESIDUAL, SPLIT)


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | IntScales | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-5, swiglu_input: bool = False,
         residual: torch.Tensor | None = None, config: GemvConfig | None = None,
         workspace: SplitWorkspace | None = None) -> torch.Tensor:
    """y [M, N] = prologue(x) @ W^T (* scale per row), rounded to x's dtype (+ residual).

    x: [M, K] (bf16/fp16, M in 1..16), or [M, 2K] gate | up with `swiglu_input`; w: [N, K] in
    x's dtype, float8_e4m3fn with `scale` [N] float32, or uint8 codes [N, K * bits / 8] with an
    `IntScales`; norm_weight [K]: RMSNorm x first; residual [M, N]: added after rounding;
    `config` overrides `config_for`; `workspace` (the layer's) keeps the K split's counters
    across calls and graph replays (without one a split call zeroes fresh counters)."""
    check_inputs(x, w, scale, norm_weight, swiglu_input, residual)
    m = x.shape[0]
    n, k = logical_shape(w, scale)
    kind = weight_kind(w, scale)
    cfg = config if config is not None else config_for(n, k, m, kind)
    ints = scale if isinstance(scale, IntScales) else None
    block_k, dot = int_tile(cfg, ints.layout) if ints is not None else (cfg.block_k, cfg.dot)
    bm = 16 if dot else row_bucket(m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), cfg.split_k) * block_k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    p = c = y  # (unused without a split)
    if cfg.split_k > 1:
        p = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)  # [S, M, N]
        c = (workspace.row_counters(n, x.device) if workspace is not None
             else torch.zeros(grid[0], dtype=torch.int32, device=x.device))  # [>= row blocks]
    nw = norm_weight if norm_weight is not None else y
    r = residual if residual is not None else y
    # the RMS pass reads up to 8192 values a step, so few dependent loads precede the matmul
    norm_bk = min(triton.next_power_of_2(k), max(block_k, 8192 // bm)) if norm_weight is not None else 16
    shared = dict(NORM=norm_weight is not None, SWIGLU=swiglu_input, RESIDUAL=residual is not None,
                  SPLIT=cfg.split_k, STAGES=cfg.num_stages, NORM_BK=norm_bk, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if ints is not None:
        words = w.view(torch.int32)  # [N, K * bits / 32]
        int_args = (x, words, ints.scales, ints.offsets, nw, r, y, p, c, m, n, k, ints.scales.shape[1], k_per_split,
                    x.stride(0), words.stride(0), r.stride(0), y.stride(0), eps)
        if ints.layout.bits == 4 and bm == 1:
            _int4_row_kernel[grid](*int_args, BN=cfg.block_n, BK=block_k, GROUP=ints.layout.group_size, **shared)
        else:
            _int_gemv_kernel[grid](*int_args, BM=bm, BN=cfg.block_n, BK=block_k, DOT=dot, BITS=ints.layout.bits,
                                   GROUP=ints.layout.group_size, **shared)
    else:
        _gemv_kernel[grid](
            x, w, scale if scale is not None else y, nw, r, y, p, c, m, n, k, k_per_split, x.stride(0), w.stride(0),
            r.stride(0), y.stride(0), eps, BM=bm, BN=cfg.block_n, BK=block_k, DOT=dot, FP8=kind == "fp8",
            SCALED=scale is not None, **shared)
    return y
