"""The attention kernels over a flat batch (Triton's interpreter on the CPU; skipped without
triton) against `reference_attention`: a paged pool of 4-position blocks, a batch of a
prefill chunk after cached context (the prefill kernel, tiles crossing rows' edges), decode
rows and a verification block (the split-KV kernel over its tokens alone), and a tree block
with its ancestor rule."""

from __future__ import annotations

import torch

from helpers.interpreted import interpreted_outputs
from infer.cache.block_tables import BlockTables
from infer.cache.forward_batch import Row, RowTree, build_batch, plan_batch
from infer.models.layers.paged_attention import reference_attention

HQ, HKV, D, BLOCK, BLOCKS = 4, 2, 16, 4, 40
ROWS = BLOCK * BLOCKS + 1


def _case(tree: bool):
    g = torch.Generator().manual_seed(5 if tree else 4)
    tables = BlockTables(4, 16, "cpu")
    order = torch.randperm(BLOCKS, generator=g).tolist()  # blocks scattered over the pool
    for slot in range(4):
        tables.set(slot, 0, order[slot * 10:(slot + 1) * 10])
    if tree:  # g and 4 nodes: 1, 2 children of g, 3 of 1, 4 of 2
        rule = RowTree([0b00001, 0b00011, 0b00101, 0b01011, 0b10101], [0, 1, 1, 2, 2], 0, 5)
        rows = [Row(0, 17, [1] * 5, logits=5, tree=rule), Row(1, 3, [2])]
    else:
        rows = [Row(0, 9, [1] * 21), Row(1, 30, [2]), Row(2, 12, [3] * 4, logits=4), Row(3, 0, [4] * 18)]
    batch = build_batch(plan_batch(rows), tables, BLOCK, ROWS - 1, "cpu")
    n = batch.num_tokens
    return batch, torch.randn(n, HQ, D, generator=g), torch.randn(ROWS, HKV, D, generator=g), \
        torch.randn(ROWS, HKV, D, generator=g)


def _split(batch, q, k, v, tokens=None, out=None, pad: int = 0) -> torch.Tensor:
    """The split-KV kernel over the batch (its tokens, or `tokens` alone), with `pad` padding
    tokens after the batch's (row 0, position -1, as a CUDA graph's bucket pads a batch)."""
    from infer.models.kernels.arrivals import ArrivalCounters
    from infer.models.kernels.split_attention import split_attention
    rows, positions = batch.token_rows, batch.positions
    if pad:
        q = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=torch.Generator().manual_seed(9))])
        rows = torch.cat([rows, torch.zeros(pad, dtype=torch.long)])
        positions = torch.cat([positions, torch.full((pad,), -1)])
    tree = None if batch.tree is None else (batch.tree.bits[:, 0].contiguous(), batch.tree.base, batch.tree.width)
    if tree is not None and pad:
        tree = (torch.cat([tree[0], torch.zeros(pad, dtype=torch.long)]), torch.cat([tree[1], positions[-pad:] + 1]),
                tree[2])
    return split_attention(q, k, v, rows, batch.query_start, positions, batch.seq_lens, batch.block_tables, BLOCK,
                           batch.context_width, ArrivalCounters("cpu"), tokens, tree, out)


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    import infer.models.kernels.split_attention as kernel
    from infer.models.kernels.prefill_attention import prefill_attention
    out = {}
    for runs, tile in (("", kernel.QUERY_TILE), (" in runs of two", 2 * HQ // HKV)):
        kernel.QUERY_TILE = tile  # (runs of two: the 4- and 5-token rows take several programs' runs)
        batch, q, k, v = _case(tree=False)
        short, long = [1, 2], [0, 3]
        starts = batch.query_start.tolist()
        tokens = torch.tensor([t for b in short for t in range(starts[b], starts[b + 1])])
        y = _split(batch, q, k, v, tokens, out=torch.zeros_like(q))
        prefill_attention(q, k, v, batch.token_rows, batch.positions, batch.seq_lens, batch.block_tables, BLOCK,
                          starts, long, out=y, blocks=(16, 16))
        out["mixed" + runs] = y
        batch, q, k, v = _case(tree=True)
        out["tree" + runs] = _split(batch, q, k, v)
        out["tree, padded" + runs] = _split(batch, q, k, v, pad=3)
    return out


def test_the_kernels_match_the_reference_over_a_flat_batch():
    got = interpreted_outputs("test_flat_attention_interpreted")
    for runs in ("", " in runs of two"):
        for name, tree in (("mixed", False), ("tree", True)):
            batch, q, k, v = _case(tree)
            expected = reference_attention(q, k, v, batch)
            torch.testing.assert_close(got[name + runs], expected, rtol=1e-4, atol=1e-4)
            if tree:  # padding tokens past the rows: the rows' results as without them, zeros for the padding
                padded = got["tree, padded" + runs]
                torch.testing.assert_close(padded[:batch.num_tokens], expected, rtol=1e-4, atol=1e-4)
                assert not padded[batch.num_tokens:].any()
