"""CacheView: the AttentionView over a KV pool, for one forward pass.

Both pool layouts store keys and values as rows of `[layers, rows, kv_heads, head_dim]`
tensors; a pool turns (slot, position) into a row number (slotted: slot * max_seq_len +
pos; paged: block * block_size + offset) and keeps one extra *scratch row* at the end. So one
view serves both: every token of the padded batch is written (padding goes to the scratch
row), each sequence's context rows are gathered (padding again points at the scratch row)
and a position mask hides what a query may not see (tree speculation adds a static
`BlockMask`: each node sees the context and its ancestors only). All index tensors have
fixed shapes for a given (batch, width, context width), so a CUDA graph can capture a
forward through a view and replay it after new indices are copied into the same tensors.
On CUDA, attention reads the rows in place instead: Triton kernels for chunks of up to
TRITON_MAX_CHUNK tokens (models/triton_attention.py) and for longer ones, prompt prefill
(models/triton_prefill.py); a view with a block mask, and the CPU, gather and mask.

A *packed* layout (`BatchLayout.packed`: a mixed step's decode rows and prefill chunks)
runs only its valid tokens through the model, as one row [1, N]: its `PackedView` writes
them to their rows and, for attention alone, scatters the queries into padded rows the
attention paths read (`unpack_rows`), then gathers the outputs back (`pack_rows`), one
group of rows at a time: the one-token rows (decode) as [D, 1], the others [B - D, T]. So
neither the projections and the MLP nor a decode row's attention see padding.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from infer.models.attention import masked_attention, position_mask
from infer.models.paged_attention import write_kv
from infer.transfer import tensor_on, to_device

RowsFn = Callable[[int, int, int], torch.Tensor]
"""rows_of(slot, start, end) -> CPU LongTensor [end - start] of storage rows of positions start..end-1."""


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where the tokens of one forward pass sit (host-side description)."""

    slots: tuple[int, ...]  # [B] pool slot per row
    start_positions: tuple[int, ...]  # [B] tokens already cached before this chunk
    chunk_lens: tuple[int, ...]  # [B] valid tokens in this row (rest is right padding)
    width: int  # T: padded row length
    # the forward runs the valid tokens alone, as one row [1, N] (N = sum(chunk_lens)), and
    # returns each row's last-token logits [B, V]; attention still sees the rows [B, T]
    packed: bool = False

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.start_positions) == len(self.chunk_lens)):
            raise ValueError("slots, start_positions and chunk_lens must have one entry per row")
        if any(n < 1 or n > self.width for n in self.chunk_lens):
            raise ValueError(f"chunk_lens must be in 1..{self.width}, got {self.chunk_lens}")
        if any(s < 0 for s in self.start_positions):
            raise ValueError("start_positions must be >= 0")

    @classmethod
    def of(cls, slots: Sequence[int], start_positions: Sequence[int], chunk_lens: Sequence[int],
           width: int | None = None, packed: bool = False) -> BatchLayout:
        return cls(tuple(slots), tuple(start_positions), tuple(chunk_lens),
                   width if width is not None else max(chunk_lens), packed)

    @property
    def ends(self) -> list[int]:
        return [s + n for s, n in zip(self.start_positions, self.chunk_lens, strict=True)]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[B, T] absolute position of every (row, column); padding continues the count."""
        start = torch.tensor(self.start_positions, dtype=torch.long)
        return to_device(start[:, None] + torch.arange(self.width)[None, :], device)

    def last_token_indices(self, device: torch.device | str) -> torch.Tensor:
        """[B] column of each row's last valid token (for logits_indices); packed: its index
        in the packed row."""
        if self.packed:
            return tensor_on([o + n - 1 for o, n in zip(self.token_offsets(), self.chunk_lens, strict=True)],
                             device, torch.long)
        return tensor_on([n - 1 for n in self.chunk_lens], device, torch.long)

    def packing(self, device: torch.device | str, rows: Sequence[int] | None = None,
                width: int | None = None) -> torch.Tensor:
        """[N] the flat index (i * width + t) of each valid token of `rows` (default: all, at
        the layout's width) in [len(rows), width], in row order."""
        rows, width = range(len(self.chunk_lens)) if rows is None else rows, width or self.width
        return tensor_on([i * width + t for i, b in enumerate(rows) for t in range(self.chunk_lens[b])],
                         device, torch.long)

    def token_offsets(self) -> list[int]:
        """Where each row's first token sits in the packed row."""
        return list(itertools.accumulate(self.chunk_lens, initial=0))[:-1]


def pack_rows(x: torch.Tensor, packing: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, N, ...]: the valid tokens' entries (packing: [N] flat indices)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, packing)[None]


def unpack_rows(x: torch.Tensor, packing: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[1, N, ...] -> [B, T, ...]: the valid tokens at their places, zeros for padding."""
    out = x.new_zeros(batch * width, *x.shape[2:])
    return out.index_copy_(0, packing, x[0]).view(batch, width, *x.shape[2:])


@dataclass(frozen=True, slots=True)
class ViewIndices:
    write_rows: torch.Tensor  # [B * T] storage row per batch token (padding -> scratch row)
    gather_rows: torch.Tensor  # [B, S] storage row per context position (padding -> scratch row)
    q_pos: torch.Tensor  # [B, T] absolute position of each query (= the model's positions)
    ctx_end: torch.Tensor  # [B] context length after this chunk (keys >= ctx_end are padding)

    def to(self, device: torch.device) -> ViewIndices:
        return ViewIndices(*(to_device(x, device)
                             for x in (self.write_rows, self.gather_rows, self.q_pos, self.ctx_end)))

    def mask(self) -> torch.Tensor:
        """[B, T, S] bool: key j visible to query t iff j <= q_pos[t] and j < ctx_end."""
        return position_mask(self.q_pos, self.ctx_end, self.gather_rows.shape[1])


# above this many rows `layout_indices` fills the write rows, positions and gather tails with
# whole-batch tensor ops (a fixed ~10 ops) instead of ~5 small ops a row: x1.7-2.0 faster at
# batch 16-32 on the dev CPU, slower below ~4 rows (host work bounds a small model's steps)
_ROWWISE_MAX = 4


def layout_indices(layout: BatchLayout, rows_of: RowsFn, scratch_row: int,
                   context_width: int | None = None, out: ViewIndices | None = None) -> ViewIndices:
    """Host-side index tensors for a layout; context_width pads S (>= the longest context).

    With `out` (tensors of a CUDA graph's staging buffer: leading dimension a batch bucket
    >= the layout's batch, S = context_width), the first rows are filled in place and `out`
    is returned; every write row past them goes to the scratch row."""
    ends = layout.ends
    width_s = context_width if context_width is not None else max(ends)
    if width_s < max(ends):
        raise ValueError(f"context_width {width_s} < longest context {max(ends)}")
    batch, t = len(layout.slots), layout.width
    if out is None:
        write = torch.full((batch, t), scratch_row, dtype=torch.long)
        gather = torch.full((batch, width_s), scratch_row, dtype=torch.long)
    else:
        write, gather = out.write_rows.view(-1, t), out.gather_rows
        write.fill_(scratch_row)
    if batch <= _ROWWISE_MAX:
        for b, (slot, start, n) in enumerate(zip(layout.slots, layout.start_positions, layout.chunk_lens,
                                                 strict=True)):
            ctx = rows_of(slot, 0, start + n)  # [start + n]
            write[b, :n] = ctx[start:]
            gather[b, :start + n] = ctx
            if out is not None:
                gather[b, start + n:] = scratch_row
                torch.arange(start, start + t, out=out.q_pos[b])
        if out is None:
            return ViewIndices(write.view(-1), gather, layout.positions("cpu"), torch.tensor(ends, dtype=torch.long))
        out.ctx_end[:batch] = torch.tensor(ends, dtype=torch.long)
        return out
    for b, (slot, end) in enumerate(zip(layout.slots, ends, strict=True)):
        gather[b, :end] = rows_of(slot, 0, end)
    ends_t = torch.tensor(ends, dtype=torch.long)  # [B]
    cols = torch.arange(max(width_s, t))
    q_pos = torch.tensor(layout.start_positions, dtype=torch.long)[:, None] + cols[:t]  # [B, T]
    if out is not None:  # (fresh tensors hold scratch there already)
        gather[:batch].masked_fill_(cols[:width_s] >= ends_t[:, None], scratch_row)
    chunk = write[:batch]  # [B, T]: each row's positions start.. in its context, padding to scratch
    torch.gather(gather[:batch], 1, q_pos.clamp(max=width_s - 1), out=chunk)
    chunk.masked_fill_(q_pos >= ends_t[:, None], scratch_row)
    if out is None:
        return ViewIndices(write.view(-1), gather, q_pos, ends_t)
    out.q_pos[:batch] = q_pos
    out.ctx_end[:batch] = ends_t
    return out


@dataclass(frozen=True, slots=True)
class BlockMask:
    """A visibility rule inside a block of consecutive positions (tree speculation).

    Every row of the batch holds a block of W positions starting at its own base; a chunk's
    query t is block row first_row + t (so base = q_pos[:, 0] - first_row). Keys below the
    base (the context) follow the usual rule; a key at base + c is visible to query t only
    where rows[t, c] (and the usual rule) allows it. `rows`: bool [T, W] on the device, one
    rule for every row (a static tree), or [B, T, W], a rule per row (dynamic trees)."""

    rows: torch.Tensor  # [T, W] or [B, T, W] bool
    first_row: int

    def visibility(self, q_pos: torch.Tensor, s: int) -> torch.Tensor:
        """[B, T, S] bool: True where the block rule allows key s to query t (keys outside
        the block: always True). q_pos: [B, T] storage positions of the queries."""
        batch, t = q_pos.shape
        width = self.rows.shape[-1]
        base = q_pos[:, :1] - self.first_row  # [B, 1]
        rel = torch.arange(s, device=q_pos.device)[None, :] - base  # [B, S]
        inside = (rel >= 0) & (rel < width)  # [B, S]
        rows = self.rows.expand(batch, t, width)  # [B, T, W]
        allowed = rows.gather(2, rel.clamp(0, width - 1)[:, None, :].expand(batch, t, s))  # [B, T, S]
        return allowed | ~inside[:, None, :]


TRITON_MAX_CHUNK = 128  # longer chunks (prompt prefill) go to the flash prefill kernel


def use_triton_attention(q: torch.Tensor) -> bool:
    """The Triton decode kernel serves short chunks (decode, draft steps and catch-up,
    verification, short prompts) on CUDA with a power-of-two head_dim >= 16."""
    d = q.shape[-1]
    return q.is_cuda and q.shape[1] <= TRITON_MAX_CHUNK and d >= 16 and d & (d - 1) == 0 and triton_available()


def use_triton_prefill(q: torch.Tensor) -> bool:
    """The Triton flash prefill kernel serves longer chunks (prompt prefill, chunked or after a
    prefix-cache hit) on CUDA, any head_dim up to 256; the CPU, and anything else, uses
    gather + masked SDPA."""
    if not (q.is_cuda and q.shape[1] > TRITON_MAX_CHUNK and triton_available()):
        return False
    from infer.models.triton_prefill import prefill_supported
    return prefill_supported(q.shape[-1])


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class CacheView:
    """AttentionView writing to / reading from row-indexed KV storage."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: ViewIndices,
                 on_commit: Callable[[], None] | None = None, block: BlockMask | None = None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache  # [L, rows, Hkv, D]
        self.indices = indices
        self._on_commit = on_commit
        # tree speculation: the block rule (in the Triton kernel on CUDA, else gather + SDPA)
        self.block = block
        self._mask: torch.Tensor | None = None
        self._bits: torch.Tensor | None = None  # the block rule as the kernel's bit sets

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [rows, Hkv, D]
        return self.attend_written(layer, self.write(kc, vc, q, k, v, rotary), kc, vc)

    def attend_written(self, layer: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Attention of q [B, T, Hq, D] (rotated) over the rows' context, this chunk's k/v
        already written to kc, vc (one layer's caches): [B, T, Hq, D]."""
        idx = self.indices
        if use_triton_attention(q):
            from infer.models.triton_attention import MAX_BLOCK, block_bits, paged_decode_attention
            if self.block is None:
                return paged_decode_attention(q, kc, vc, idx.gather_rows, idx.q_pos, idx.ctx_end)
            width = self.block.rows.shape[-1]
            if width <= MAX_BLOCK:
                if layer == 0 or self._bits is None:  # once per forward
                    self._bits = block_bits(self.block.rows)
                return paged_decode_attention(q, kc, vc, idx.gather_rows, idx.q_pos, idx.ctx_end,
                                              (self._bits, self.block.first_row, width))
        if self.block is None and use_triton_prefill(q):
            from infer.models.triton_prefill import paged_prefill_attention
            return paged_prefill_attention(q, kc, vc, idx.gather_rows, idx.q_pos, idx.ctx_end)
        if layer == 0 or self._mask is None:  # once per forward (inside a captured graph too)
            self._mask = idx.mask()
            if self.block is not None:
                self._mask = self._mask & self.block.visibility(idx.q_pos, idx.gather_rows.shape[1])
        k_ctx = kc[idx.gather_rows]  # [B, S, Hkv, D]
        v_ctx = vc[idx.gather_rows]
        return masked_attention(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), self._mask)

    def write(self, kc: torch.Tensor, vc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Write the chunk's k and v ([B, T, Hkv, D]) into their rows of one layer's caches
        (rotating q and k first when `rotary` (cos, sin) is given: on CUDA one Triton kernel
        does both, `models/triton_rotary.py`); returns q, rotated if asked."""
        return write_kv(kc, vc, q, k, v, rotary, self.indices.write_rows)

    def commit(self) -> None:
        """Advance each slot's length past this chunk (call after the forward pass)."""
        if self._on_commit is not None:
            self._on_commit()


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Rows of a packed layout that attend together, padded to one width."""

    view: CacheView  # over these rows alone, [R, W]
    tokens: torch.Tensor  # [M] their tokens' places in the packed row
    packing: torch.Tensor  # [M] their tokens' flat places in [R, W]
    dense: bool = False  # every token of the packed row, each row W long: [1, N] is [R, W] as it is


class PackedView:
    """The AttentionView of a packed layout: q, k, v arrive as [1, N, H, D]; k and v are
    written to their rows at once, then each group of rows attends in its padded form."""

    def __init__(self, writer: CacheView, groups: Sequence[RowGroup]) -> None:
        self.writer = writer  # its write rows: the packed tokens' [N]
        self.groups = tuple(groups)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        kc, vc = self.writer.k_cache[layer], self.writer.v_cache[layer]  # [rows, Hkv, D]
        q = self.writer.write(kc, vc, q, k, v, rotary)  # [1, N, Hq, D]
        if self.groups[0].dense:  # (a prefill of equal chunks: no padding, no copies)
            view = self.groups[0].view
            rows, width = view.indices.q_pos.shape
            return view.attend_written(layer, q.reshape(rows, width, *q.shape[2:]), kc, vc).reshape(q.shape)
        out = torch.empty_like(q[0])  # [N, Hq, D]
        for g in self.groups:
            rows, width = g.view.indices.q_pos.shape
            padded = unpack_rows(q[:, g.tokens], g.packing, rows, width)  # [R, W, Hq, D]
            out.index_copy_(0, g.tokens, pack_rows(g.view.attend_written(layer, padded, kc, vc), g.packing)[0])
        return out[None]

    def commit(self) -> None:
        self.writer.commit()


def packed_view(k_cache: torch.Tensor, v_cache: torch.Tensor, indices: ViewIndices, layout: BatchLayout,
                on_commit: Callable[[], None]) -> PackedView:
    """The view of a packed layout from its indices over [B, T] (on the device): one-token
    rows attend as [D, 1], the others at the layout's width."""
    device = indices.q_pos.device
    offsets = layout.token_offsets()
    writer = CacheView(k_cache, v_cache, replace(indices, write_rows=indices.write_rows.index_select(
        0, layout.packing(device))), on_commit)
    groups = []
    for one in (True, False):
        rows = [b for b, n in enumerate(layout.chunk_lens) if (n == 1) == one]
        if not rows:
            continue
        width = 1 if one else layout.width
        picked = tensor_on(rows, device, torch.long)
        sub = ViewIndices(indices.write_rows[:0], indices.gather_rows.index_select(0, picked),
                          indices.q_pos.index_select(0, picked)[:, :width], indices.ctx_end.index_select(0, picked))
        tokens = [offsets[b] + t for b in rows for t in range(layout.chunk_lens[b])]
        dense = len(rows) == len(layout.chunk_lens) and all(n == width for n in layout.chunk_lens)
        groups.append(RowGroup(CacheView(k_cache, v_cache, sub), tensor_on(tokens, device, torch.long),
                               layout.packing(device, rows, width), dense))
    return PackedView(writer, groups)


def pool_view(pool: object, layout: BatchLayout) -> CacheView | PackedView:
    """The eager view of a pool for one forward: validated indices moved to the device once;
    `view.commit()` calls `pool.commit(layout)`."""
    indices = pool.indices(layout).to(pool.k_cache.device)  # type: ignore[attr-defined]
    commit = functools.partial(pool.commit, layout)  # type: ignore[attr-defined]
    if layout.packed:
        return packed_view(pool.k_cache, pool.v_cache, indices, layout, commit)  # type: ignore[attr-defined]
    return CacheView(pool.k_cache, pool.v_cache, indices, commit)  # type: ignore[attr-defined]


class RowPool:
    """`commit` and `view` of the row-indexed pools; a subclass keeps `_lens` (tokens per
    slot) and provides `indices(layout)`."""

    _lens: dict[int, int]

    def commit(self, layout: BatchLayout) -> None:
        for slot, end in zip(layout.slots, layout.ends, strict=True):
            self._lens[slot] = end

    def set_length(self, slot: int, length: int) -> None:
        """The slot holds positions < length (after a forward pass wrote them)."""
        self._lens[slot] = length

    def view(self, layout: BatchLayout) -> CacheView | PackedView:
        return pool_view(self, layout)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        k_cache: torch.Tensor = self.k_cache  # type: ignore[attr-defined]  # [layers, rows + 1, Hkv, D]
        v_cache: torch.Tensor = self.v_cache  # type: ignore[attr-defined]
        src_t, dst_t = tensor_on(list(src), k_cache.device, torch.long), tensor_on(list(dst), k_cache.device,
                                                                                   torch.long)  # [M]
        for cache in (k_cache, v_cache):
            cache.index_copy_(1, dst_t, cache.index_select(1, src_t))
