"""Building a ForwardBatch from the rows of a step: which slot, from which position, which
tokens, which logits, which tree rule.

The host describes each row (`Row`) and `build_batch` lays the batch out with a few vector
operations: per-token positions, batch rows and tree rule, per-row context lengths and the
logits' token indices, copied to the device in one transfer. The KV slot each token writes
is computed on the device from the pool's block tables (`BlockTables`, kept there), so no
per-token storage row is built on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer.cache.block_tables import BlockTables
from infer.models.batch import ForwardBatch, TreeRule


@dataclass(frozen=True, slots=True)
class RowTree:
    """A row's tokens inside a tree block: the block starts `base_offset` positions from
    the row's first token (<= 0: g, or the cached part, precedes it), is `width` positions
    wide; token t sees block key c where bit c of bits[t] is set, and is rotated at the
    block's first position plus rope_offsets[t] (a node's depth)."""

    bits: Sequence[int]  # [n]
    rope_offsets: Sequence[int]  # [n]
    base_offset: int
    width: int


@dataclass(frozen=True, slots=True)
class Row:
    slot: int
    start: int  # the storage position of the row's first token this pass
    ids: Sequence[int]  # its tokens (a caller may put device ids in their place: `build_batch`)
    logits: int = 1  # logits of its last `logits` tokens (0: none; len(ids): all)
    tree: RowTree | None = None

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError(f"a row computes at least one token (slot {self.slot})")
        if not 0 <= self.logits <= len(self.ids):
            raise ValueError(f"logits must be 0..{len(self.ids)} for a row of {len(self.ids)} tokens, got {self.logits}")
        if self.tree is not None and len(self.tree.bits) != len(self.ids):
            raise ValueError(f"a tree row needs one rule per token: {len(self.tree.bits)} for {len(self.ids)}")


def _layout(rows: Sequence[Row]) -> dict[str, np.ndarray]:
    """The host arrays of a batch (int64 each)."""
    lens = np.array([len(r.ids) for r in rows], dtype=np.int64)  # [B]
    starts = np.array([r.start for r in rows], dtype=np.int64)  # [B]
    query_start = np.concatenate([[0], np.cumsum(lens)])  # [B + 1]
    n = int(query_start[-1])
    token_rows = np.repeat(np.arange(len(rows), dtype=np.int64), lens)  # [N]
    positions = starts[token_rows] + np.arange(n, dtype=np.int64) - query_start[token_rows]  # [N]
    rope = positions.copy()
    trees = [b for b, r in enumerate(rows) if r.tree is not None]
    bits = np.zeros(n, dtype=np.int64)
    base = positions + 1  # (outside any tree: no key of the rule)
    for b in trees:
        tree, lo, hi = rows[b].tree, query_start[b], query_start[b + 1]
        assert tree is not None
        bits[lo:hi] = tree.bits
        base[lo:hi] = starts[b] + tree.base_offset
        rope[lo:hi] = starts[b] + tree.base_offset + np.asarray(tree.rope_offsets, dtype=np.int64)
    wanted = [np.arange(query_start[b + 1] - r.logits, query_start[b + 1]) for b, r in enumerate(rows) if r.logits]
    return {"ids": np.concatenate([np.asarray(r.ids, dtype=np.int64) for r in rows]), "positions": positions,
            "rope": rope, "token_rows": token_rows, "row_slots": np.array([r.slot for r in rows], dtype=np.int64),
            "query_start": query_start, "seq_lens": starts + lens,
            "logits": np.concatenate(wanted) if wanted else np.zeros(0, dtype=np.int64), "bits": bits, "base": base}


def build_batch(rows: Sequence[Row], tables: BlockTables, block_size: int, scratch_row: int,
                device: torch.device | str) -> ForwardBatch:
    """The ForwardBatch of `rows` on `device`: one host-to-device copy, the KV slots and
    block tables gathered there."""
    if not rows:
        raise ValueError("a forward batch needs at least one row")
    host = _layout(rows)
    names = list(host)
    flat = torch.from_numpy(np.concatenate([host[k] for k in names]))
    if torch.device(device).type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    parts = dict(zip(names, torch.split(flat, [host[k].shape[0] for k in names]), strict=True))
    trees = [r.tree.width for r in rows if r.tree is not None]
    block_tables = tables.sync().index_select(0, parts["row_slots"])  # [B, max_blocks]
    return ForwardBatch(
        token_ids=parts["ids"], positions=parts["positions"], rope_positions=parts["rope"],
        slots=token_slots(block_tables, parts["token_rows"], parts["positions"], block_size, scratch_row),
        token_rows=parts["token_rows"], block_tables=block_tables, query_start=parts["query_start"],
        seq_lens=parts["seq_lens"], logits_indices=parts["logits"],
        tree=TreeRule(parts["bits"], parts["base"], max(trees)) if trees else None,
        query_lens=tuple(len(r.ids) for r in rows), context_width=int(host["seq_lens"].max()),
        block_size=block_size)


def token_slots(block_tables: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int,
                scratch_row: int) -> torch.Tensor:
    """[N] the storage row each token writes: its position's block of its row's table
    (a padding token, position < 0: the scratch row)."""
    safe = positions.clamp(min=0)
    rows = block_tables[token_rows, safe // block_size] * block_size + safe % block_size
    return torch.where(positions >= 0, rows, scratch_row)
