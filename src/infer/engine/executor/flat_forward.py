"""`ForwardFn` over the flat batch forward: the padded-layout calls of the runner's older
paths (a `BatchLayout` of rows, a tree chunk) laid out as flat rows and run by the one
forward (`batch_forward`), logits put back in the shape each call returns.

This is the bridge while the step's callers move to building their rows themselves; every
forward, eager or graphed, already runs through the flat batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds, Row, RowTree, plan_batch
from infer.cache.view import BatchLayout
from infer.engine.executor.batch_forward import EagerBatchForward, GraphBatchForward
from infer.engine.executor.forward import sample_logits, verify_on_logits, verify_on_tree_logits
from infer.speculative.node_tree import RowTreeChunk
from infer.speculative.tree import TreeChunk


def _row_bits(mask: torch.Tensor) -> list[int]:
    """bool [T, W] -> per row the bit set of its True columns."""
    return [sum(1 << c for c in torch.nonzero(row).flatten().tolist()) for row in mask.cpu()]


@functools.lru_cache(maxsize=256)
def _static_rule(chunk: TreeChunk) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A static chunk's (bits, rotary offsets from the block's first position) per row."""
    offsets = (chunk.rotary_offsets() + chunk.first_row).tolist()
    return tuple(_row_bits(chunk.mask())), tuple(offsets)


class FlatForward:
    """A `ForwardFn` whose every call is one pass of `fn` (eager or graphed) over flat rows."""

    def __init__(self, fn: EagerBatchForward | GraphBatchForward) -> None:
        self.fn = fn
        self.device = fn.device

    def _run(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool,
             trees: Sequence[RowTree] | None = None) -> torch.Tensor:
        """Logits [M, V]: every token of each row (all_logits), or each row's last."""
        lens = layout.chunk_lens
        on_device = ids.device.type != "cpu"
        host = torch.zeros((len(lens), ids.shape[1]), dtype=torch.long) if on_device else ids
        rows = [Row(slot, start, host[b, :n].tolist(), n if all_logits else 1, None if trees is None else trees[b])
                for b, (slot, start, n) in enumerate(zip(layout.slots, layout.start_positions, lens, strict=True))]
        device_ids = None
        if on_device:  # (ids from the step before: every row's tokens, in order, are the batch's)
            valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < torch.tensor(lens, device=ids.device)[:, None]
            device_ids = DeviceIds(tuple(range(sum(lens))), ids[valid])
        return self.fn(plan_batch(rows), device_ids)

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        """The one forward (`ForwardFn.run`)."""
        return self.fn(plan, device_ids)

    @property
    def replays(self) -> int:
        """CUDA graph replays so far (0 eagerly)."""
        return getattr(self.fn, "replays", 0)

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        """ids [B, T] (CPU, or the device) -> logits [B, T, V] (all_logits; padding columns
        repeat the row's last token's) or [B, V] of each row's last token."""
        if layout.packed and all_logits:
            raise ValueError("a packed layout gives each row's last-token logits only: call with all_logits=False")
        logits = self._run(ids, layout, all_logits)
        return self._unflatten(logits, layout.chunk_lens, layout.width) if all_logits else logits

    def _unflatten(self, logits: torch.Tensor, lens: Sequence[int], width: int) -> torch.Tensor:
        """[sum(lens), V] -> [B, width, V] (a short row's padding repeats its last entry)."""
        starts = [sum(lens[:b]) for b in range(len(lens))]
        index = torch.tensor([[s + min(t, n - 1) for t in range(width)] for s, n in zip(starts, lens, strict=True)],
                             device=logits.device)
        return logits[index]

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_logits(self(ids, layout, all_logits=False), temperatures, uniforms, greedy)

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        return verify_on_logits(self(ids, layout, all_logits=True), draft_tokens, counts, draft_probs, temperatures,
                                greedy, uniforms)

    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> torch.Tensor:
        """A tree chunk: each row's first chunk_lens[b] block rows, their rule and rotary
        positions from the chunk -> logits [B, chunk.width, V]."""
        if layout.width != chunk.width:
            raise ValueError(f"a tree chunk of {chunk.width} rows needs a layout {chunk.width} wide, got {layout.width}")
        block = (chunk.mask() if isinstance(chunk, TreeChunk) else chunk.mask).shape[-1]  # the block's rows
        trees = []
        for b, n in enumerate(layout.chunk_lens):
            if isinstance(chunk, TreeChunk):
                bits, offsets = _static_rule(chunk)
            else:
                bits = tuple(_row_bits(chunk.mask[b]))
                offsets = tuple((chunk.offsets[b] + chunk.first_row).tolist())
            trees.append(RowTree(bits[:n], offsets[:n], -chunk.first_row, block))
        return self._unflatten(self._run(ids, layout, True, trees), layout.chunk_lens, layout.width)

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk,
                    node_tokens: torch.Tensor, node_valid: torch.Tensor, draft_probs: torch.Tensor | None,
                    temperatures: Sequence[float], greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        assert chunk.shape is not None  # (a draft level's chunk is never verified)
        return verify_on_tree_logits(chunk.shape, self.tree(ids, layout, chunk), node_tokens, node_valid,
                                     draft_probs, temperatures, greedy, uniforms)

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        return False  # (nothing needs padding: a graph serves any short rows of its token count)

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        pass
