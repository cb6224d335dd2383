"""Triton matmul for the linear layers: y = x @ W^T (W bf16/fp16, or FP8 E4M3 with a per-row
scale in the epilogue), with optional fused epilogues `swiglu` (W = [gate; up]) and `residual`.

FP8 weights and activations multiply in fp16, accumulating in float32; the output rounds to
x's dtype before the SwiGLU or residual add, as PyTorch's. With split K, the last program of a
tile adds the partial sums in a fixed order and resets its counter (CUDA-graph replay safe)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.models.kernels.matmul_tiles import LinearConfig, SplitWorkspace


@triton.jit
def _epilogue(acc, acc2, Y, R, S, rm, rn, M, N, I, s_ym, s_rm,
              FP8: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr):
    out_ty = Y.dtype.element_ty
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if FP8:
        acc = acc * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
        if SWIGLU:
            acc2 = acc2 * tl.load(S + I + rn, mask=rn < N, other=0.0)[None, :]
    out = acc.to(out_ty)
    if SWIGLU:
        g = out.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(out_ty)
        out = (silu.to(tl.float32) * acc2.to(out_ty).to(tl.float32)).to(out_ty)
    if RESIDUAL:
        r = tl.load(R + rm[:, None] * s_rm + rn[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(Y + rm[:, None] * s_ym + rn[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, S, R, Y, P, C, M, N, K, I, TILES_PER_SPLIT, s_xm, s_wn, s_rm, s_ym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                   STAGES: tl.constexpr, FP8: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                   PARTS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_k * TILES_PER_SPLIT * BK  # this program's K range: TILES_PER_SPLIT tiles from k0
    x_ptrs = X + rm[:, None] * s_xm + (k0 + rk)[None, :]
    w_ptrs = W + rn[:, None] * s_wn + (k0 + rk)[None, :]
    acc = tl.zeros((BM, BN), tl.float32)
    acc2 = tl.zeros((BM, BN), tl.float32)
    for kt in tl.range(0, TILES_PER_SPLIT, num_stages=STAGES):
        k_ok = (k0 + kt * BK + rk) < K
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
        if FP8:  # E4M3 -> fp16 converts natively; bf16 would not
            x = x.to(tl.float16)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if SWIGLU:
            w2 = tl.load(w_ptrs + I * s_wn, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            acc2 = tl.dot(x, tl.trans(w2.to(x.dtype)), acc2)
        x_ptrs += BK
        w_ptrs += BK
    if SPLIT_K == 1:
        _epilogue(acc, acc2, Y, R, S, rm, rn, M, N, I, s_ym, s_rm, FP8, SWIGLU, RESIDUAL)
    else:
        tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = pid_m * tl.num_programs(0) + pid_n
        cell = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(P + ((pid_k * PARTS) * tiles + tile) * BM * BN + cell, acc)
        if SWIGLU:
            tl.store(P + ((pid_k * PARTS + 1) * tiles + tile) * BM * BN + cell, acc2)
        done = tl.atomic_add(C + tile, 1)  # acq_rel: the partial sums above are visible to the last
        if done == SPLIT_K - 1:
            acc = tl.zeros((BM, BN), tl.float32)
            acc2 = tl.zeros((BM, BN), tl.float32)
            for s in tl.static_range(SPLIT_K):  # a fixed order: the sum does not depend on timing
                acc += tl.load(P + ((s * PARTS) * tiles + tile) * BM * BN + cell, cache_modifier=".cg")
                if SWIGLU:
                    acc2 += tl.load(P + ((s * PARTS + 1) * tiles + tile) * BM * BN + cell, cache_modifier=".cg")
            tl.atomic_xchg(C + tile, 0)
            _epilogue(acc, acc2, Y, R, S, rm, rn, M, N, I, s_ym, s_rm, FP8, SWIGLU, RESIDUAL)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, cfg: LinearConfig,
                  workspace: SplitWorkspace | None = None, residual: torch.Tensor | None = None,
                  swiglu: bool = False) -> torch.Tensor:
    """x: [M, K] (bf16/fp16, contiguous in K); weight: [N_w, K] (x's dtype, or float8_e4m3fn with
    `scale` [N_w] fp32); residual: [M, N] or None. Returns [M, N] in x's dtype, N = N_w (swiglu: N_w / 2)."""
    m, k = x.shape
    n_w = weight.shape[0]
    n = n_w // 2 if swiglu else n_w
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 and scale is None:
        raise ValueError("an FP8 weight needs its per-row scale")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid_n, grid_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    split = cfg.split_k
    partials = counters = y  # (unused without a split)
    if split > 1:
        if workspace is None:
            raise ValueError("split_k > 1 needs a SplitWorkspace")
        tiles = grid_n * grid_m
        partials, counters = workspace.get(split * (2 if swiglu else 1) * tiles * cfg.block_m * cfg.block_n,
                                           tiles, x.device)
    res = residual if residual is not None else y
    _linear_kernel[(grid_n, grid_m, split)](
        x, weight, scale if scale is not None else y, res, y, partials, counters, m, n, k, n,
        triton.cdiv(triton.cdiv(k, cfg.block_k), split),
        x.stride(0), weight.stride(0), res.stride(0), y.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SPLIT_K=split, STAGES=cfg.num_stages,
        FP8=fp8, SWIGLU=swiglu, RESIDUAL=residual is not None, PARTS=2 if swiglu else 1, num_warps=cfg.num_warps)
    return y
