"""A GGUF file's header read straight from its memory map: metadata and the tensor table.

GGUF v2/v3, little-endian: magic, version u32, tensor and metadata counts u64; metadata entries (key, type u32,
value); then per tensor: name, dimension count u32, dimensions u64 (innermost first), ggml type u32, data offset u64;
data starts at a multiple of `general.alignment` (32). String arrays decode only when asked for; a file cut short
raises `ValueError`."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

STRING, ARRAY, BOOL = 8, 9, 7
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
Q = GGMLQuantizationType
_NUMERIC = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
            Q.I32: np.int32, Q.I64: np.int64}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class HeaderField:
    """A metadata value where it lies in the file: decoded by `value`."""

    buf: np.ndarray
    kind: int
    offset: int
    count: int = 1  # items of an array
    item_kind: int = -1  # an array's item type

    def value(self) -> Any:
        """str, int, float, bool, or a list of them (an array)."""
        if self.kind != ARRAY:
            return _scalar(self.buf, self.kind, self.offset)[0]
        if self.item_kind == STRING:
            out, off = [], self.offset
            for _ in range(self.count):
                text, off = _string(self.buf, off)
                out.append(text)
            return out
        return np.frombuffer(self.buf, _DTYPES[self.item_kind], self.count, self.offset).tolist()


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [rows, cols]
    data: np.ndarray  # values (F16/F32/...) or blocks (uint8, [rows, bytes per row])
    n_bytes: int


def _scalar(buf: np.ndarray, kind: int, off: int) -> tuple[Any, int]:
    if kind == STRING:
        return _string(buf, off)
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown metadata value type {kind} at byte {off}")
    return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)


def _string(buf: np.ndarray, off: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, off)
    end = off + 8 + length
    if end > len(buf):
        raise ValueError(f"a string at byte {off} runs past the end of the file")
    return bytes(buf[off + 8:end]).decode("utf-8"), end


def _field(buf: np.ndarray, kind: int, off: int) -> tuple[HeaderField, int]:
    """The field of type `kind` at `off`, and the offset after it."""
    if kind != ARRAY:
        return HeaderField(buf, kind, off), _scalar(buf, kind, off)[1]
    item, count = struct.unpack_from("<IQ", buf, off)
    start = off + 12
    if item == STRING:
        end = start
        for _ in range(count):
            end += 8 + struct.unpack_from("<Q", buf, end)[0]
    elif item in _DTYPES:
        end = start + count * np.dtype(_DTYPES[item]).itemsize
    else:
        raise ValueError(f"metadata arrays of type {item} are not supported (byte {off})")
    if end > len(buf):
        raise ValueError(f"a metadata array at byte {off} runs past the end of the file")
    return HeaderField(buf, ARRAY, start, count, item), end


def map_file(path: Path) -> mmap.mmap:
    """The file mapped read-only (its pages are read as they are touched)."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def release(mapped: mmap.mmap, data: np.ndarray) -> None:
    """Drop the resident pages of a tensor's data once read (still mapped: read again if touched)."""
    start = data.ctypes.data - np.frombuffer(mapped, np.uint8, 1).ctypes.data
    first = start - start % mmap.PAGESIZE
    if data.nbytes:
        mapped.madvise(mmap.MADV_DONTNEED, first, start + data.nbytes - first)


def read_header(mapped: mmap.mmap) -> tuple[dict[str, HeaderField], list[TensorEntry]]:
    """The metadata fields by key and the tensors of a mapped GGUF file."""
    buf = np.frombuffer(mapped, np.uint8)
    try:
        magic, version, n_tensors, n_fields = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
        off, fields = 24, {}
        for _ in range(n_fields):
            key, off = _string(buf, off)
            (kind,) = struct.unpack_from("<I", buf, off)
            fields[key], off = _field(buf, kind, off + 4)
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            kind, data_off = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            infos.append((name, Q(kind), tuple(reversed(dims)), data_off))
            off += 4 + 8 * n_dims + 12
    except struct.error as exc:
        raise ValueError(f"the header ends early ({exc})") from exc
    align = fields["general.alignment"].value() if "general.alignment" in fields else DEFAULT_ALIGNMENT
    start = -(-off // align) * align
    return fields, [_tensor(buf, start, *info) for info in infos]


def _tensor(buf: np.ndarray, start: int, name: str, kind: GGMLQuantizationType, shape: tuple[int, ...],
            data_off: int) -> TensorEntry:
    block, size = GGML_QUANT_SIZES[kind]
    n_elems = int(np.prod(shape))
    n_bytes = n_elems * size // block
    begin = start + data_off
    if begin + n_bytes > len(buf):
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    raw = buf[begin:begin + n_bytes]
    if kind in _NUMERIC:
        data = raw.view(_NUMERIC[kind]).reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], shape[-1] // block * size)
    return TensorEntry(name, kind, shape, data, n_bytes)
