"""Building a ForwardBatch from the rows of a step: which slot, from which position, which
tokens, which logits, which tree rule.

`plan_batch` lays the rows (`Row`) out on the host; `build_batch` copies them to the device in
one transfer, where each token's KV slot is gathered from the pool's block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from infer.cache.block_tables import BlockTables
from infer.models.batch import WORD, ForwardBatch, TreeRule, rule_words
from infer.transfer import tensor_on


@dataclass(frozen=True, slots=True)
class RowTree:
    """A row's tokens inside a tree block that starts `base_offset` (<= 0) positions from the
    row's first token and is `width` wide: token t sees block key c where bit c of bits[t] is
    set, and is rotated at the block's start plus rope_offsets[t]."""

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


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch laid out on the host: int64 arrays by name (`ARRAYS`), and the facts kernels plan with."""

    arrays: dict[str, np.ndarray]
    query_lens: tuple[int, ...]
    tree_width: int  # 0: no tree row

    @property
    def num_tokens(self) -> int:
        return self.arrays["ids"].shape[0]

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def num_logits(self) -> int:
        return self.arrays["logits"].shape[0]

    @property
    def context_width(self) -> int:
        return int(self.arrays["seq_lens"].max())

    @property
    def ends(self) -> list[tuple[int, int]]:
        """(slot, context length after the pass) per row."""
        return list(zip(self.arrays["row_slots"].tolist(), self.arrays["seq_lens"].tolist(), strict=True))


# per token: ids, positions, rope, token_rows, bits, base; per row: row_slots, seq_lens; query_start [B + 1];
# logits [M]
ARRAYS = ("ids", "positions", "rope", "token_rows", "bits", "base", "row_slots", "seq_lens", "query_start", "logits")


def plan_batch(rows: Sequence[Row]) -> BatchPlan:
    """Lay the rows out on the host (per-row facts as Python lists: cheaper than numpy for a few rows)."""
    if not rows:
        raise ValueError("a forward batch needs at least one row")
    lens = [len(r.ids) for r in rows]  # [B]
    starts = [r.start for r in rows]  # [B]
    query_start = np.fromiter(accumulate(lens, initial=0), dtype=np.int64, count=len(rows) + 1)  # [B + 1]
    n = int(query_start[-1])
    token_rows = np.repeat(np.arange(len(rows), dtype=np.int64), lens)  # [N]
    # position of token t of row b: starts[b] + t - query_start[b]
    positions = np.arange(n, dtype=np.int64) + np.repeat(np.subtract(starts, query_start[:-1]), lens)  # [N]
    ends = query_start[1:].tolist()
    wanted = [i for r, end in zip(rows, ends, strict=True) for i in range(end - r.logits, end)]
    trees = [(b, r.tree) for b, r in enumerate(rows) if r.tree is not None]
    width = max((t.width for _, t in trees), default=0)
    words = rule_words(max(width, 1))
    bits = np.zeros((n, words), dtype=np.int64)
    base = positions + 1  # (outside any tree: no key of the rule)
    rope = positions.copy()
    for b, tree in trees:
        lo, hi, origin = ends[b] - lens[b], ends[b], starts[b] + tree.base_offset
        if words == 1:  # (one word a token: its bits as a signed int64)
            bits[lo:hi, 0] = [x - (1 << WORD) if x >> (WORD - 1) else x for x in tree.bits]
        else:
            bits[lo:hi] = [_words(x, words) for x in tree.bits]
        base[lo:hi] = origin
        rope[lo:hi] = origin + np.asarray(tree.rope_offsets, dtype=np.int64)
    arrays = {"ids": np.fromiter(chain.from_iterable(r.ids for r in rows), dtype=np.int64, count=n),
              "positions": positions, "rope": rope, "token_rows": token_rows, "bits": bits.reshape(-1), "base": base,
              "row_slots": np.array([r.slot for r in rows], dtype=np.int64),
              "seq_lens": np.add(starts, lens, dtype=np.int64), "query_start": query_start,
              "logits": np.array(wanted, dtype=np.int64)}
    return BatchPlan(arrays, tuple(lens), width)


@dataclass(frozen=True, slots=True)
class DeviceIds:
    """Token ids already on the device: batch tokens `at` take `ids`. `grid` lets `place` write
    them through a strided view when every row is alike; `shift` [B] (<= 0) moves each row's
    start on the device (a round following one whose verdict the host has not read)."""

    at: tuple[int, ...]  # [k] token indices in the batch
    ids: torch.Tensor  # [k] long, on the device
    grid: tuple[int, int, int] | None = None  # (stride, skip, n): at[b n + t] = b stride + skip + t
    shift: torch.Tensor | None = None  # [B] long, on the device

    def place(self, token_ids: torch.Tensor) -> None:
        """Write the ids into a batch's token ids [N] (N covering `at`)."""
        if self.grid is None:
            token_ids.index_copy_(0, tensor_on(self.at, token_ids.device, torch.long), self.ids)
            return
        stride, skip, n = self.grid
        rows = len(self.at) // n
        token_ids[:rows * stride].view(rows, stride)[:, skip:skip + n].copy_(self.ids.view(rows, n))

    def apply(self, parts: dict[str, torch.Tensor], tokens: int) -> None:
        """Write the ids into a batch's device arrays (named as `ARRAYS`; its first `tokens`
        tokens the plan's) and move its rows by `shift`."""
        self.place(parts["ids"])
        if self.shift is not None:
            shift_rows(parts, self.shift, tokens)


def shift_rows(parts: dict[str, torch.Tensor], shift: torch.Tensor, tokens: int) -> None:
    """Move each row b of a batch's device arrays by shift[b] positions (positions, rotary, rule
    bases, context length); padding tokens and rows stay as they are."""
    moved = shift.index_select(0, parts["token_rows"][:tokens])  # [T]
    for name in ("positions", "rope", "base"):
        parts[name][:tokens] += moved
    parts["seq_lens"][:shift.shape[0]] += shift


def _words(bits: int, words: int) -> list[int]:
    """A rule's bit set as int64 words, low bits first (two's complement past bit 62)."""
    out = []
    for _ in range(words):
        word = bits & ((1 << WORD) - 1)
        out.append(word - (1 << WORD) if word >= 1 << (WORD - 1) else word)
        bits >>= WORD
    return out


def build_batch(plan: BatchPlan, tables: BlockTables, block_size: int, scratch_row: int,
                device: torch.device | str, device_ids: DeviceIds | None = None) -> ForwardBatch:
    """The ForwardBatch of a plan on `device`: one host-to-device copy, the KV slots and
    block tables gathered there (`device_ids` applied first)."""
    host = plan.arrays
    flat = torch.from_numpy(np.concatenate([host[k] for k in ARRAYS]))
    if torch.device(device).type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    parts = dict(zip(ARRAYS, torch.split(flat, [host[k].shape[0] for k in ARRAYS]), strict=True))
    if device_ids is not None:
        device_ids.apply(parts, plan.num_tokens)
    return batch_of(parts, tables.sync(), block_size, scratch_row, plan.query_lens, plan.context_width,
                    plan.tree_width)


def batch_of(parts: dict[str, torch.Tensor], tables: torch.Tensor, block_size: int, scratch_row: int,
             query_lens: tuple[int, ...], context_width: int, tree_width: int) -> ForwardBatch:
    """A ForwardBatch over device arrays named as `ARRAYS` (the pool's block tables [slots,
    max_blocks] on the device): its block tables and KV slots gathered from them."""
    block_tables = tables.index_select(0, parts["row_slots"])  # [B, max_blocks]
    return ForwardBatch(
        token_ids=parts["ids"], positions=parts["positions"], rope_positions=parts["rope"],
        slots=token_slots(block_tables, parts["token_rows"], parts["positions"], block_size, scratch_row),
        token_rows=parts["token_rows"], block_tables=block_tables, query_start=parts["query_start"],
        seq_lens=parts["seq_lens"], logits_indices=parts["logits"],
        tree=TreeRule(parts["bits"].view(-1, rule_words(tree_width)), parts["base"], tree_width) if tree_width else None,
        query_lens=query_lens, context_width=context_width, block_size=block_size)


def token_slots(block_tables: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int,
                scratch_row: int) -> torch.Tensor:
    """[N] the storage row each token writes: its position's block of its row's table
    (a padding token, position < 0: the scratch row)."""
    safe = positions.clamp(min=0)
    rows = block_tables[token_rows, safe // block_size] * block_size + safe % block_size
    return torch.where(positions >= 0, rows, scratch_row)


def next_step(batch: ForwardBatch, ids: torch.Tensor, ahead: int, scratch_row: int,
              context_width: int) -> ForwardBatch:
    """One token a row, built on the device: ids [B]; row b writes position seq_lens[b] + ahead
    of its slot. A row without context stays padding (position -1, the scratch row)."""
    rows = batch.seq_lens.shape[0]
    live = batch.seq_lens > 0  # [B]
    positions = torch.where(live, batch.seq_lens + ahead, -1)  # [B]
    token_rows = torch.arange(rows, device=ids.device)  # [B]
    return ForwardBatch(
        token_ids=ids, positions=positions, rope_positions=positions,
        slots=token_slots(batch.block_tables, token_rows, positions, batch.block_size, scratch_row),
        token_rows=token_rows, block_tables=batch.block_tables,
        query_start=torch.arange(rows + 1, device=ids.device), seq_lens=torch.where(live, positions + 1, 0),
        logits_indices=token_rows, tree=None, query_lens=(1,) * rows, context_width=context_width,
        block_size=batch.block_size)
