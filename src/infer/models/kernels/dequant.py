"""Integer weights to a dense W [N, K] = s * q + o on the GPU in one pass, for calls too wide for
the GEMV (made per call: only the packed codes stay resident)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.models.layers.int_quant import IntScales

_BLOCK_N, _BLOCK_K = 16, 256


@triton.jit
def _dequant_kernel(W, GS, GO, Y, N, K, G, s_wn, BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    kk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (kk[None, :] < K)
    groups = rn[:, None] * G + (kk // GROUP)[None, :]
    s = tl.load(GS + groups, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(GO + groups, mask=mask, other=0.0).to(tl.float32)
    if BITS == 4:
        b = tl.load(W + rn[:, None] * s_wn + (kk // 2)[None, :], mask=mask, other=0)
        q = (b >> ((kk % 2) * 4).to(tl.uint8)[None, :]) & 15
    else:
        q = tl.load(W + rn[:, None] * s_wn + kk[None, :], mask=mask, other=0)
    tl.store(Y + rn[:, None] * K + kk[None, :], (q.to(tl.float32) * s + o).to(Y.dtype.element_ty), mask=mask)


def dequantize_on_device(w: torch.Tensor, ints: IntScales) -> torch.Tensor:
    """Packed codes w uint8 [N, K * bits / 8] -> W [N, K] in the scales' dtype."""
    n = w.shape[0]
    k = w.shape[1] * 8 // ints.layout.bits
    y = torch.empty((n, k), dtype=ints.scales.dtype, device=w.device)  # [N, K]
    _dequant_kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K))](
        w, ints.scales, ints.offsets, y, n, k, ints.scales.shape[1], w.stride(0), BITS=ints.layout.bits,
        GROUP=ints.layout.group_size, BN=_BLOCK_N, BK=_BLOCK_K, num_warps=4)
    return y
