"""GGUF quantized blocks as infer's integer layout (layers/int_quant.py): float32 s and o, exactly `gguf`'s values.

    Q4_0  4-bit/32: s = d, o = -8 d        Q4_K  4-bit/32: s = d * sc, o = -dmin * m
    Q4_1  4-bit/32: s = d, o = m           Q5_K  8-bit/32: as Q4_K, codes of 5 bits
    Q8_0  8-bit/32: s = d, o = -128 d      Q6_K  8-bit/16: s = d * sc, o = -32 s
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from infer.models.layers.int_quant import IntLayout, PackedRows, pack_codes
from infer.models.loading.gguf.reader import GGUFTensor

Q = GGMLQuantizationType
KEPT_LAYOUTS: dict[GGMLQuantizationType, IntLayout] = {
    Q.Q4_0: IntLayout(4, 32), Q.Q4_1: IntLayout(4, 32), Q.Q4_K: IntLayout(4, 32),
    Q.Q5_K: IntLayout(8, 32), Q.Q6_K: IntLayout(8, 16), Q.Q8_0: IntLayout(8, 32),
}

Blocks = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes [B, block], scales and offsets [B, groups]


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes a row -> float32 [B, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [B, n * width] (per run of `width` bytes: low nibbles values j, high ones j + width)
    -> [B, n * 2 * width] in value order."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return np.concatenate([runs & 15, runs >> 4], axis=2).reshape(qs.shape[0], -1)


def _q4_0(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8 * d


def _q4_1(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 4:], 16), d, _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 q -> q + 128


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (scales, offsets) [B, 8] from d, dmin and the 6-bit scales and mins."""
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> Blocks:
    s, o = _k_scales(b)
    return _nibbles(b[:, 16:], 32), s, o


def _q5_k(b: np.ndarray) -> Blocks:
    s, o = _k_scales(b)
    low = _nibbles(b[:, 48:], 32).reshape(b.shape[0], 8, 32)
    high = (b[:, 16:48].reshape(b.shape[0], 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(b.shape[0], 256), s, o


def _q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    codes = (low | (high.reshape(n, 8, 32) << 4)).reshape(n, 256)
    s = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return codes, s, -32 * s


_BLOCKS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.Q8_0: _q8_0}


def repack(tensor: GGUFTensor) -> PackedRows:
    """A kept type's matrix [rows, K] as `PackedRows` in its KEPT_LAYOUTS layout."""
    layout = KEPT_LAYOUTS[tensor.ggml_type]
    rows, k = tensor.shape
    data = np.asarray(tensor.data, dtype=np.uint8)
    block = GGML_QUANT_SIZES[tensor.ggml_type][0]  # values a block holds
    codes, scales, offsets = _BLOCKS[tensor.ggml_type](data.reshape(rows * k // block, -1))
    packed = pack_codes(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, k)), layout.bits)
    groups = layout.groups(k)
    return PackedRows(layout, packed, torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, groups)),
                      torch.from_numpy(np.ascontiguousarray(offsets).reshape(rows, groups)))

