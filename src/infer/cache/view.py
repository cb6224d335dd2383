"""CacheView: the AttentionView over a KV pool, for one forward pass.

Both pool layouts store keys and values as rows of `[layers, rows, kv_heads, head_dim]`
tensors; a pool turns (slot, position) into a row number (slotted: slot * max_seq_len +
pos; paged: block * block_size + offset). So one view serves both: it scatters the new
tokens' k/v to their rows, gathers each sequence's context rows, and masks by position.
The pool computes the index tensors once per forward; every layer reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.models.attention import context_mask, masked_attention


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where the tokens of one forward pass sit (host-side description)."""

    slots: tuple[int, ...]  # [B] pool slot per row
    start_positions: tuple[int, ...]  # [B] tokens already cached before this chunk
    chunk_lens: tuple[int, ...]  # [B] valid tokens in this row (rest is right padding)
    width: int  # T: padded row length

    def __post_init__(self) -> None:
        if not (len(self.slots) == len(self.start_positions) == len(self.chunk_lens)):
            raise ValueError("slots, start_positions and chunk_lens must have one entry per row")
        if any(n < 1 or n > self.width for n in self.chunk_lens):
            raise ValueError(f"chunk_lens must be in 1..{self.width}, got {self.chunk_lens}")
        if any(s < 0 for s in self.start_positions):
            raise ValueError("start_positions must be >= 0")

    @classmethod
    def of(cls, slots: Sequence[int], start_positions: Sequence[int], chunk_lens: Sequence[int],
           width: int | None = None) -> BatchLayout:
        return cls(tuple(slots), tuple(start_positions), tuple(chunk_lens),
                   width if width is not None else max(chunk_lens))

    @property
    def ends(self) -> list[int]:
        return [s + n for s, n in zip(self.start_positions, self.chunk_lens, strict=True)]

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """[B, T] absolute position of every (row, column); padding continues the count."""
        start = torch.tensor(self.start_positions, dtype=torch.long, device=device)
        return start[:, None] + torch.arange(self.width, device=device)[None, :]

    def last_token_indices(self, device: torch.device | str) -> torch.Tensor:
        """[B] column of each row's last valid token (for logits_indices)."""
        return torch.tensor([n - 1 for n in self.chunk_lens], dtype=torch.long, device=device)


class CacheView:
    """AttentionView writing to / reading from row-indexed KV storage."""

    def __init__(
        self,
        k_cache: torch.Tensor,  # [L, rows, Hkv, D]
        v_cache: torch.Tensor,  # [L, rows, Hkv, D]
        layout: BatchLayout,
        write_rows: torch.Tensor,  # [N] storage row of each valid new token
        write_src: torch.Tensor,  # [N] flat index (b * T + t) of that token in the batch
        gather_rows: torch.Tensor,  # [B, S] storage row of each context position
        on_commit: Callable[[], None],
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.layout = layout
        self.write_rows, self.write_src, self.gather_rows = write_rows, write_src, gather_rows
        device = k_cache.device
        start = torch.tensor(layout.start_positions, dtype=torch.long, device=device)
        lens = torch.tensor(layout.chunk_lens, dtype=torch.long, device=device)
        self.mask = context_mask(start, lens, layout.width, gather_rows.shape[1])  # [B, T, S]
        self._on_commit = on_commit

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [rows, Hkv, D]
        heads, dim = kc.shape[1], kc.shape[2]
        kc.index_copy_(0, self.write_rows, k.reshape(-1, heads, dim)[self.write_src].to(kc.dtype))
        vc.index_copy_(0, self.write_rows, v.reshape(-1, heads, dim)[self.write_src].to(vc.dtype))
        k_ctx = kc[self.gather_rows]  # [B, S, Hkv, D]
        v_ctx = vc[self.gather_rows]
        return masked_attention(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), self.mask)

    def commit(self) -> None:
        """Advance each slot's length past this chunk (call after the forward pass)."""
        self._on_commit()


RowsFn = Callable[[int, int, int], torch.Tensor]
"""rows_of(slot, start, end) -> [end - start] storage rows of positions start..end-1 (long)."""


def build_view(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BatchLayout, rows_of: RowsFn,
               on_commit: Callable[[], None]) -> CacheView:
    """Index tensors for a layout: new tokens' rows, their batch positions, context rows.

    Context rows past a row's end are padded with row 0 (masked out, but a valid index).
    """
    device = k_cache.device
    ends = layout.ends
    width_s = max(ends)
    write_rows, write_src, gather = [], [], []
    for b, (slot, start, n) in enumerate(zip(layout.slots, layout.start_positions, layout.chunk_lens,
                                             strict=True)):
        ctx = rows_of(slot, 0, start + n)  # [start + n]
        write_rows.append(ctx[start:])
        write_src.append(torch.arange(n, device=device) + b * layout.width)
        gather.append(torch.nn.functional.pad(ctx, (0, width_s - ctx.shape[0])))
    return CacheView(k_cache, v_cache, layout, torch.cat(write_rows), torch.cat(write_src),
                     torch.stack(gather), on_commit)
