"""Which kernel serves which call: the one place that routes the decoder's work.

Projections (`route`): `GEMV` (gemv.py), `MATMUL` (matmul.py) or `LIBRARY` (the layer's own
forward), by weight kind, part and row bucket (`ROUTES`). Attention (`AttentionRoutes`): rows of
up to DECODE_MAX_QUERY tokens take split_attention.py, longer ones prefill_attention.py; where
the kernels do not apply (CPU, odd head size, wide tree rule), `REFERENCE` (masked SDPA)."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from infer.models.batch import WORD
from infer.models.kernels.gemv_tiles import MAX_ROWS, ROW_BUCKETS, WEIGHT_KINDS, row_bucket, weight_kind
from infer.models.layers.linear import LinearBase

Tensor = torch.Tensor

GEMV, MATMUL, LIBRARY = "gemv", "matmul", "library"
PARTS = ("linear", "gate_up")
# (weight kind, part) -> route per row bucket 1, 2, 4, 8, 16, from `scripts/bench_gemv.py`
# (docs/benchmarks.md); integer codes always take the GEMV (the Triton matmul takes none).
ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("bf16", "linear"): (GEMV, LIBRARY, LIBRARY, LIBRARY, LIBRARY),
    ("bf16", "gate_up"): (GEMV, LIBRARY, LIBRARY, LIBRARY, LIBRARY),
    ("fp8", "linear"): (GEMV, MATMUL, MATMUL, MATMUL, MATMUL),
    ("fp8", "gate_up"): (GEMV, MATMUL, MATMUL, MATMUL, MATMUL),
    ("int4", "linear"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int4", "gate_up"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int8", "linear"): (GEMV, GEMV, GEMV, GEMV, GEMV),
    ("int8", "gate_up"): (GEMV, GEMV, GEMV, GEMV, GEMV),
}
INT_KINDS = ("int4", "int8")  # weight kinds the Triton matmul does not take


def check_routes(routes: dict[tuple[str, str], tuple[str, ...]]) -> None:
    """Raise a ValueError naming the entry to fix in a route table."""
    for kind in WEIGHT_KINDS:
        for part in PARTS:
            chosen = routes.get((kind, part))
            if chosen is None or len(chosen) != len(ROW_BUCKETS):
                raise ValueError(f"ROUTES[({kind!r}, {part!r})] must give one route per row bucket {ROW_BUCKETS}")
            allowed = (GEMV, LIBRARY) if kind in INT_KINDS else (GEMV, MATMUL, LIBRARY)
            if any(r not in allowed for r in chosen):
                names = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise ValueError(f"ROUTES[({kind!r}, {part!r})] = {chosen}: each must be {names}")


check_routes(ROUTES)


def table_route(kind: str, part: str, rows: int) -> str:
    """`ROUTES`' choice for a weight kind, a part and a row count (over MAX_ROWS: `LIBRARY`)."""
    if not 1 <= rows <= MAX_ROWS:
        return LIBRARY
    return ROUTES[(kind, part)][ROW_BUCKETS.index(row_bucket(rows))]


def route(layer: LinearBase, x: Tensor, part: str = "linear") -> str:
    """The route of `layer` on x [..., K]: the table's (CUDA, half precision, no bias), else `LIBRARY`."""
    if layer.bias is not None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return LIBRARY
    return table_route(weight_kind(*layer.matrix()), part, x.numel() // x.shape[-1])


DECODE_MAX_QUERY = 128  # longer rows attend with the flash prefill kernel
SPLIT_KV, PREFILL, REFERENCE = "split-kv", "prefill", "reference"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels_serve(q: Tensor) -> bool:
    """Whether the Triton attention kernels serve queries [N, Hq, D] (CUDA, power-of-two head_dim >= 16)."""
    d = q.shape[-1]
    return q.is_cuda and d >= 16 and d & (d - 1) == 0 and triton_available()


def rotary_write_fused(q: Tensor) -> bool:
    """Whether the rotary of q [..., D] and k and the KV write run as one Triton kernel."""
    return q.is_cuda and triton_available()


def row_attention(query_len: int) -> str:
    """The kernel of a row of `query_len` tokens where the kernels serve: SPLIT_KV or PREFILL."""
    return SPLIT_KV if query_len <= DECODE_MAX_QUERY else PREFILL


@dataclass(frozen=True)
class AttentionRoutes:
    """A flat batch's rows by kernel (host lists) and whether the kernels apply its tree rule
    (one word, and no long rows beside it)."""

    split_kv: list[int]  # rows of up to DECODE_MAX_QUERY tokens
    prefill: list[int]  # longer rows
    kernels_fit: bool

    @classmethod
    def of(cls, query_lens: tuple[int, ...], tree_width: int | None) -> AttentionRoutes:
        split_kv = [b for b, n in enumerate(query_lens) if row_attention(n) == SPLIT_KV]
        prefill = [b for b, n in enumerate(query_lens) if row_attention(n) == PREFILL]
        return cls(split_kv, prefill, cls.tree_fits(bool(prefill), tree_width))

    @staticmethod
    def tree_fits(has_prefill: bool, tree_width: int | None) -> bool:
        """Whether the kernels apply a batch's tree rule (None: no tree)."""
        return tree_width is None or (not has_prefill and tree_width <= WORD)

    @staticmethod
    def split_kv_only(longest_query: int, tree_width: int | None) -> bool:
        """Whether every row (longest: `longest_query` tokens) takes the split-KV kernel with its tree rule."""
        short = row_attention(longest_query) == SPLIT_KV
        return short and AttentionRoutes.tree_fits(not short, tree_width)

    def reference(self, q: Tensor) -> bool:
        """Whether queries q [N, Hq, D] of this batch take `REFERENCE` attention."""
        return not (self.kernels_fit and kernels_serve(q))
