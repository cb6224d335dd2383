"""What the padded calls of `ForwardFn` (speculative/forward.py; laid out as flat rows by
engine/executor/flat_forward.py, sent to tensor-parallel ranks by distributed/mirror.py)
still take: `BatchLayout`, the rows of such a call, and `BlockMask`, a tree's rule over
padded rows. Every forward itself runs over the flat batch (cache/forward_batch.py); these
go with the last padded call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where the tokens of one padded call sit (host-side description)."""

    slots: tuple[int, ...]  # [B] pool slot per row
    start_positions: tuple[int, ...]  # [B] tokens already cached before this chunk
    chunk_lens: tuple[int, ...]  # [B] valid tokens in this row (rest is right padding)
    width: int  # T: padded row length
    packed: bool = False  # each row's last-token logits only (the call's [B, V])

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
