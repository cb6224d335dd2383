"""Weight-only integer quantization: 4- or 8-bit codes with a scale and an offset per group.

Group j (`group_size` columns) of row n of W [N, K] holds codes q in 0..2^bits - 1 and dequantizes as
w = s[n, j] * q + o[n, j] (a zero point z gives o = -s * z). Codes are packed into uint8 along K (4-bit: column 2j
in the low nibble of byte j, 2j + 1 in the high one); scales and offsets [N, K / group_size] in the model's dtype.
`PackedRows`: a checkpoint's rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT_BITS = (4, 8)
GROUP_SIZES = (128, 64, 32, 16)  # group sizes quantize-at-load tries, largest first
_MIN_STEP = 1e-12  # a group of equal values keeps a finite, positive scale


@dataclass(frozen=True, slots=True)
class IntLayout:
    """How a matrix is stored: `bits` per code, one scale and offset per `group_size` columns."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in INT_BITS:
            raise ValueError(f"integer weights have {' or '.join(map(str, INT_BITS))} bits, got {self.bits}")
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"the group size must be an even number >= 2, got {self.group_size}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def groups(self, k: int) -> int:
        """Groups of a row of `k` columns; an error when `k` does not split into them."""
        if k % self.group_size:
            raise ValueError(f"rows of {k} columns do not split into groups of {self.group_size}")
        return k // self.group_size

    def packed_width(self, k: int) -> int:
        """Bytes of a packed row of `k` codes."""
        return k * self.bits // 8

    def holds(self, other: IntLayout) -> bool:
        """Whether rows stored as `other` convert to this layout without loss."""
        return self.bits >= other.bits and other.group_size % self.group_size == 0


def default_group(k: int, preferred: int = GROUP_SIZES[0]) -> int:
    """The largest of GROUP_SIZES (up to `preferred`) that divides `k`; an error if none."""
    for size in GROUP_SIZES:
        if size <= preferred and k % size == 0:
            return size
    raise ValueError(f"rows of {k} columns split into none of the group sizes {GROUP_SIZES}: "
                     "int4 quantization needs an input size divisible by 16")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [N, K] (each < 2^bits) -> packed uint8 [N, K * bits / 8]."""
    if bits == 8:
        return codes.to(torch.uint8)
    pairs = codes.to(torch.uint8).contiguous().view(torch.int16)  # c0 | c1 << 8 (little-endian)
    return ((pairs & 15) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [N, K * bits / 8] -> codes uint8 [N, K]."""
    if bits == 8:
        return packed
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def dequantize_int(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, layout: IntLayout,
                   dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] = s * q + o in `dtype` (computed in float32) from packed codes and scales, offsets [N, G]."""
    n, g = scales.shape
    w = torch.empty(n, g * layout.group_size, dtype=torch.float32, device=packed.device)  # [N, K]
    if layout.bits == 4:
        pairs = w.view(n, -1, 2)
        pairs[..., 0].copy_(packed & 15)
        pairs[..., 1].copy_(packed >> 4)
    else:
        w.copy_(packed)
    w.view(n, g, -1).mul_(scales.to(torch.float32)[..., None]).add_(offsets.to(torch.float32)[..., None])
    return w.to(dtype)


def quantize_rtn(weight: torch.Tensor, layout: IntLayout, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [N, K * bits / 8], scales [N, G], offsets [N, G] in `dtype`):
    round to nearest of 2^bits - 1 steps over each group's min..max, against the stored (rounded) s, o."""
    n, k = weight.shape
    w = weight.to(torch.float32).view(n, layout.groups(k), layout.group_size)  # [N, G, group]
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    top = (1 << layout.bits) - 1
    scales = ((high - low) / top).clamp(min=_MIN_STEP).to(dtype)
    offsets = low.to(dtype)
    s, o = scales.to(torch.float32)[..., None], offsets.to(torch.float32)[..., None]
    s = torch.where(s > 0, s, 1.0)  # (a step below `dtype`'s range rounds to 0: every code is then 0)
    codes = ((w - o) / s).round_().clamp_(0, top).to(torch.uint8).view(n, k)
    return pack_codes(codes, layout.bits), scales, offsets


@dataclass(frozen=True, slots=True)
class IntScales:
    """What a kernel reads beside packed codes: scales, offsets [N, G] (contiguous, activations' dtype), layout."""

    scales: torch.Tensor
    offsets: torch.Tensor
    layout: IntLayout


@dataclass(frozen=True)
class PackedRows:
    """Rows of W a checkpoint stores as integers, for `LinearBase.load_rows`: packed uint8 codes
    [rows, K * bits / 8], float scales and offsets [rows, K / group_size]."""

    layout: IntLayout
    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        rows, width = self.packed.shape
        k = width * 8 // self.layout.bits
        if self.packed.dtype != torch.uint8 or tuple(self.scales.shape) != (rows, self.layout.groups(k)) \
                or self.scales.shape != self.offsets.shape:
            raise ValueError(f"packed rows {tuple(self.packed.shape)} ({self.packed.dtype}) do not match scales "
                             f"{tuple(self.scales.shape)} and offsets {tuple(self.offsets.shape)} in {self.layout}")

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape [rows, K] of W's rows."""
        return self.packed.shape[0], self.packed.shape[1] * 8 // self.layout.bits

    def to_layout(self, layout: IntLayout, device: torch.device, dtype: torch.dtype) -> PackedRows:
        """The same values in `layout` (it must `hold` this one) on `device`, scales and offsets in `dtype`."""
        if not layout.holds(self.layout):
            raise ValueError(f"rows quantized as {self.layout} cannot be stored as {layout} without loss")
        packed = self.packed.to(device)
        if layout.bits != self.layout.bits:
            packed = pack_codes(unpack_codes(packed, self.layout.bits), layout.bits)
        repeat = self.layout.group_size // layout.group_size
        scales, offsets = (t.to(device=device, dtype=dtype) for t in (self.scales, self.offsets))
        if repeat > 1:
            scales, offsets = scales.repeat_interleave(repeat, dim=1), offsets.repeat_interleave(repeat, dim=1)
        return PackedRows(layout, packed, scales, offsets)

    def take_rows(self, index: torch.Tensor) -> PackedRows:
        """Rows `index` (a permutation, e.g. llama.cpp's q/k order undone)."""
        return PackedRows(self.layout, self.packed[index], self.scales[index], self.offsets[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows as a dense [rows, K] tensor."""
        return dequantize_int(self.packed, self.scales, self.offsets, self.layout, dtype)
