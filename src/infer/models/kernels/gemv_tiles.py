"""Launch parameters of the few-row matmul (`gemv.py`) per shape, and the checks of its inputs.
Pure Python and torch: importable (and tested) where Triton is absent.

`config_for` looks the shape up in `CONFIG_TABLE` (read at import from `gemv_tiles.json`, rewritten by
`scripts/bench_gemv.py --table`), else builds `default_config`. Weight kinds (`WEIGHT_KINDS`): "bf16" (any dense
half-precision W), "fp8", "int4", "int8"."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from infer.models.layers.int_quant import IntLayout, IntScales

MAX_ROWS = 16  # the kernel serves 1..MAX_ROWS rows; more rows belong to a matmul library
NUM_SMS = 132  # multiprocessors the shape heuristics size their grids for
ROW_BUCKETS = (1, 2, 4, 8, 16)  # the row tiles the FMA kernel is compiled for
WEIGHT_KINDS = ("bf16", "fp8", "int4", "int8")


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch parameters of one `gemv` call."""

    block_n: int = 16  # rows of W per program
    block_k: int = 256  # K values per loop step
    split_k: int = 1  # programs sharing one row block's K range
    dot: bool = False  # inner product on tensor cores (16-row tiles) instead of FMA
    num_warps: int = 4
    num_stages: int = 1  # 1: loads straight into registers; more: pipelined through shared memory

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.block_k < 16:
            raise ValueError(f"GemvConfig.block_k must be >= 16, got {self.block_k}")
        if self.dot and self.block_n < 16:
            raise ValueError(f"GemvConfig with dot=True needs block_n >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be >= 1, got {self.num_stages}")


def row_bucket(m: int) -> int:
    """Rows M (1..MAX_ROWS) -> the power of two the kernel's row tile is compiled for."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {m}: use a matmul (torch.nn.functional.linear)")
    return 1 << (m - 1).bit_length()


def default_config(n: int, k: int, bucket: int, kind: str) -> GemvConfig:
    """A configuration from the shape alone, modelled on the table's entries: one or two rows take
    unsplit FMA tiles, more rows dot tiles with K split to about 2.5 programs a multiprocessor
    (integer codes: `int_default`)."""
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"weight kind must be one of {WEIGHT_KINDS}, got {kind!r}")
    if kind in ("int4", "int8"):
        return int_default(n, k, bucket)
    if bucket <= 2:
        narrow = kind != "bf16" and bucket == 1
        return GemvConfig(block_n=16 if narrow else 8, block_k=512, num_warps=4, num_stages=3)
    base = GemvConfig(block_n=32, block_k=128, dot=True, num_warps=4, num_stages=3)
    blocks = -(-n // base.block_n)
    split = 1
    while 2 * blocks * split < 5 * NUM_SMS and -(-k // base.block_k) >= 4 * split:
        split *= 2
    return replace(base, split_k=split)


def int_default(n: int, k: int, bucket: int) -> GemvConfig:
    """The default for integer codes: one-group tiles, FMA at one or two rows, else dot; K split
    (at most 16, two steps a split) to three programs a multiprocessor (FMA) or two (dot)."""
    dot = bucket > 2
    block_n = 128 if dot or max(n, k) >= 8192 else 64
    blocks, steps = -(-n // block_n), -(-k // 128)
    split = 1
    while blocks * split < (2 if dot else 3) * NUM_SMS and steps // (2 * split) >= 2 and split < 16:
        split *= 2
    return GemvConfig(block_n=block_n, block_k=128, split_k=split, dot=dot, num_warps=4, num_stages=3)


def int_tile(cfg: GemvConfig, layout: IntLayout) -> tuple[int, bool]:
    """(block_k, dot) as the integer kernel runs `cfg`: a step stays inside one group, and a dot
    tile needs 16 words a row a step (else FMA)."""
    block_k = min(cfg.block_k, layout.group_size & -layout.group_size)
    return block_k, cfg.dot and block_k * layout.bits >= 16 * 32


TABLE_FILE = Path(__file__).with_name("gemv_tiles.json")  # measured; its "regenerate" says how


def read_table(path: Path = TABLE_FILE) -> dict[tuple[int, int, int, str], GemvConfig]:
    """The measured configurations of a table file: (N, K, row bucket, weight kind) -> config."""
    entries = json.loads(path.read_text(encoding="utf-8"))["entries"]
    return {(e["n"], e["k"], e["rows"], e["kind"]): GemvConfig(*e["config"]) for e in entries}


CONFIG_TABLE = read_table()  # read once at import


def config_for(n: int, k: int, m: int, kind: str) -> GemvConfig:
    """The table's configuration for this shape and weight kind, else `default_config`."""
    bucket = row_bucket(m)
    found = CONFIG_TABLE.get((n, k, bucket, kind))
    return found if found is not None else default_config(n, k, bucket, kind)


def weight_kind(w: torch.Tensor, scale: torch.Tensor | IntScales | None) -> str:
    """The kind of a GEMV weight: "int4" / "int8" with integer scales, "fp8", or "bf16"."""
    if isinstance(scale, IntScales):
        return scale.layout.name
    return "fp8" if w.dtype == torch.float8_e4m3fn else "bf16"


def logical_shape(w: torch.Tensor, scale: torch.Tensor | IntScales | None) -> tuple[int, int]:
    """(N, K) of the matrix W that `w` stores (packed integer rows hold K * bits / 8 bytes)."""
    if isinstance(scale, IntScales):
        return w.shape[0], w.shape[1] * 8 // scale.layout.bits
    return w.shape[0], w.shape[1]


def check_inputs(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | IntScales | None,
                 norm_weight: torch.Tensor | None, swiglu_input: bool, residual: torch.Tensor | None) -> None:
    """Raise a ValueError naming what to fix for inputs the kernel cannot take."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv takes x [M, K] and w [N, K], got shapes {tuple(x.shape)} and {tuple(w.shape)}")
    row_bucket(x.shape[0])
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv's x must be bfloat16 or float16, got {x.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv needs x and w contiguous along K (call .contiguous())")
    n, k = logical_shape(w, scale)
    width = 2 * k if swiglu_input else k
    if x.shape[1] != width:
        raise ValueError(f"x has {x.shape[1]} columns, w has K={k}: x must be [M, {width}]"
                         + (" (gate | up) with swiglu_input" if swiglu_input else ""))
    if isinstance(scale, IntScales):
        _check_int(w, scale, x.dtype, n, k)
    else:
        _check_float(w, scale, x.dtype, n)
    if norm_weight is not None:
        if swiglu_input:
            raise ValueError("gemv fuses either the RMSNorm or the SwiGLU prologue, not both")
        if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
            raise ValueError(f"norm_weight must be contiguous [K={k}] in x's dtype {x.dtype}, got "
                             f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != (x.shape[0], n) or residual.dtype != x.dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"residual must be [M={x.shape[0]}, N={n}] in x's dtype {x.dtype}, contiguous along N; "
                         f"got {residual.dtype} {tuple(residual.shape)}")
    extra = (scale.scales, scale.offsets) if isinstance(scale, IntScales) else (scale,)
    for name, t in (("w", w), ("scale", extra[0]), ("offsets", extra[-1]), ("norm_weight", norm_weight),
                    ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: put them on one device")


def _check_float(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, n: int) -> None:
    fp8 = w.dtype == torch.float8_e4m3fn
    if not fp8 and w.dtype != dtype:
        raise ValueError(f"w must be float8_e4m3fn or x's dtype {dtype} (or uint8 codes with IntScales), "
                         f"got {w.dtype}")
    if fp8 != (scale is not None):
        raise ValueError("an FP8 weight needs its per-row float32 scale [N], and only an FP8 weight takes one")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous()):
        raise ValueError(f"scale must be a contiguous float32 [N={n}], got {scale.dtype} {tuple(scale.shape)}")


def _check_int(w: torch.Tensor, scale: IntScales, dtype: torch.dtype, n: int, k: int) -> None:
    if w.dtype != torch.uint8:
        raise ValueError(f"integer weights are packed uint8 codes, got {w.dtype}")
    per_word = 32 // scale.layout.bits
    if scale.layout.group_size % per_word:
        raise ValueError(f"the GEMV reads {scale.layout.name} codes {per_word} a word: groups of "
                         f"{scale.layout.group_size} columns do not split into words (quantize with groups of a "
                         f"multiple of {per_word} columns)")
    if w.stride(0) % 4 or w.storage_offset() % 4:
        raise ValueError("packed integer rows must start on 4-byte boundaries (call .contiguous())")
    groups = scale.layout.groups(k)
    for name, t in (("scales", scale.scales), ("offsets", scale.offsets)):
        if t.shape != (n, groups) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [N={n}, groups={groups}] in x's dtype {dtype}, got "
                             f"{t.dtype} {tuple(t.shape)}")
