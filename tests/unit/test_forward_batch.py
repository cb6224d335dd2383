"""The flat forward batch (CPU, tiny checkpoint): prefill chunks, decode rows, verification
blocks and tree nodes of several sequences in one pass through a paged (or contiguous)
pool give each token the logits the model gives it computing its whole sequence at once
(a tree node: the sequence of its ancestors, rotated at its depth); the KV slots come from
the block tables on the device; padding and trees follow the layout's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.cache.factory import make_cache_pool
from infer.cache.forward_batch import DeviceIds, Row, RowTree, build_batch, plan_batch, token_slots
from infer.models.layers.attention import NoCacheView
from infer.models.layers.paged_attention import BatchView, key_rows
from infer.models.loading.loader import load_model


@pytest.fixture(scope="module")
def model(ckpt_a):
    return load_model(str(ckpt_a), dtype=torch.float32, device="cpu")[0]


def pool_of(model, backend: str):
    kw = dict(block_size=4, num_blocks=96) if backend == "paged" else {}
    return make_cache_pool(backend, model.config, max_batch_size=4, max_seq_len=96, dtype=torch.float32,
                           device="cpu", **kw)


@torch.inference_mode()
def run(model, pool, rows):
    """One flat pass -> logits [M, V] of the rows' wanted tokens."""
    for r in rows:
        assert pool.ensure_capacity(r.slot, r.start + len(r.ids))
    batch = build_batch(plan_batch(rows), pool.tables, pool.block_size, pool.scratch_row, "cpu")
    hidden = model.hidden_states(batch.token_ids[None], batch.rope_positions[None],
                                 BatchView(pool.k_cache, pool.v_cache, batch, pool.arrivals))[0]
    for r in rows:
        pool.set_length(r.slot, max(pool.seq_len(r.slot), r.start + len(r.ids)))
    return model.lm_head(hidden.index_select(0, batch.logits_indices))


@torch.inference_mode()
def whole(model, seq, rope=None):
    """Logits [T, V] of a sequence computed at once (no cache); rope: its rotary positions."""
    ids = torch.tensor([seq])
    positions = torch.tensor([rope if rope is not None else list(range(len(seq)))])
    return model(ids, positions, NoCacheView())[0]


SEQS = [[0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 20, 21, 22, 23, 24, 25], [0, 30, 31]]


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_mixed_rows_in_one_pass_are_each_sequence_computed_whole(model, backend):
    pool = pool_of(model, backend)
    slots = [pool.allocate_slot(0) for _ in SEQS]
    # pass 1: prefill chunks of different lengths (sequence 0 in part)
    got = run(model, pool, [Row(slots[0], 0, SEQS[0][:6]), Row(slots[1], 0, SEQS[1][:5], logits=5),
                            Row(slots[2], 0, SEQS[2][:2])])
    ref = [whole(model, SEQS[0])[5], *whole(model, SEQS[1])[:5], whole(model, SEQS[2])[1]]
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-4)
    # pass 2: the rest of a chunked prompt, a verification block (all logits), a decode row
    got = run(model, pool, [Row(slots[0], 6, SEQS[0][6:], logits=len(SEQS[0]) - 6),
                            Row(slots[1], 5, SEQS[1][5:7], logits=2), Row(slots[2], 2, SEQS[2][2:3])])
    ref = [*whole(model, SEQS[0])[6:], *whole(model, SEQS[1])[5:7], whole(model, SEQS[2])[2]]
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-4)


def test_a_tree_block_sees_each_node_s_ancestors_only(model):
    pool = pool_of(model, "paged")
    slot = pool.allocate_slot(0)
    prompt = SEQS[1][:5]
    run(model, pool, [Row(slot, 0, prompt[:-1], logits=0)])
    # g (the prompt's last token) then nodes 1: a, 2: b (children of g), 3: c (child of a)
    g, a, b, c = prompt[-1], 40, 41, 42
    bits = [0b0001, 0b0011, 0b0101, 0b1011]  # block rows: g, a, b, c; each sees itself and its ancestors
    tree = RowTree(bits, rope_offsets=[0, 1, 1, 2], base_offset=0, width=4)
    got = run(model, pool, [Row(slot, len(prompt) - 1, [g, a, b, c], logits=4, tree=tree)])
    base = prompt[:-1]
    paths = [base + [g], base + [g, a], base + [g, b], base + [g, a, c]]
    ref = [whole(model, p)[-1] for p in paths]
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-4)


def test_slots_come_from_the_block_tables_and_padding_goes_to_scratch(model):
    pool = pool_of(model, "paged")
    s0, s1 = pool.allocate_slot(0), pool.allocate_slot(0)
    assert pool.ensure_capacity(s0, 9) and pool.ensure_capacity(s1, 3)
    batch = build_batch(plan_batch([Row(s0, 6, [1, 2, 3]), Row(s1, 0, [4, 5])]), pool.tables, pool.block_size,
                        pool.scratch_row, "cpu")
    expect = [int(pool.rows(s0, p, p + 1)) for p in (6, 7, 8)] + [int(pool.rows(s1, p, p + 1)) for p in (0, 1)]
    assert batch.slots.tolist() == expect
    assert batch.positions.tolist() == [6, 7, 8, 0, 1] and batch.token_rows.tolist() == [0, 0, 0, 1, 1]
    assert batch.query_start.tolist() == [0, 3, 5] and batch.seq_lens.tolist() == [9, 2]
    assert batch.logits_indices.tolist() == [2, 4]
    padded = token_slots(batch.block_tables, torch.tensor([0, 1]), torch.tensor([-1, 1]), pool.block_size,
                         pool.scratch_row)
    assert padded.tolist() == [pool.scratch_row, expect[-1]]
    keys = key_rows(batch.block_tables, pool.block_size, 9)
    assert keys[0].tolist() == [int(x) for x in pool.rows(s0, 0, 9)]
    assert np.array_equal(pool.tables.host[s0, :3], np.array(pool.block_table(s0)))


def test_a_tree_wider_than_one_rule_word_keeps_its_rule(model):
    # 70 block positions (two int64 words a rule): two chains under row 0, the even rows and
    # the odd ones (row t's parent is t - 2; row 1's is 0)
    pool = pool_of(model, "paged")
    slot = pool.allocate_slot(0)
    run(model, pool, [Row(slot, 0, [0, 5, 6], logits=0)])
    ids = [7 + t % 50 for t in range(70)]
    bits, paths = [], []
    for t in range(70):  # block row t sees itself and its ancestors
        seen = [0] + [c for c in range(1, t + 1) if c % 2 == t % 2] if t else [0]
        bits.append(sum(1 << c for c in seen))
        paths.append(seen)
    tree = RowTree(bits, rope_offsets=[len(p) - 1 for p in paths], base_offset=0, width=70)
    got = run(model, pool, [Row(slot, 3, ids, logits=70, tree=tree)])
    ref = [whole(model, [0, 5, 6] + [ids[c] for c in p])[-1] for p in paths[::7]]
    torch.testing.assert_close(got[::7], torch.stack(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grid", [(1, 0, 1), (5, 1, 4), (3, 1, 1)])
def test_device_ids_on_a_grid_land_where_their_indices_say(grid: tuple[int, int, int]) -> None:
    # plain rows (one token each), blocks of K + 1 = 5 taking their 4 drafts, blocks of 3 with
    # one: the strided view writes exactly the tokens `at` names, the rest untouched
    stride, skip, n = grid
    rows = 3
    at = tuple(b * stride + skip + t for b in range(rows) for t in range(n))
    ids = torch.arange(100, 100 + len(at))
    by_index = torch.full((rows * stride + 2,), -1, dtype=torch.long)
    DeviceIds(at, ids).place(by_index)
    by_grid = torch.full_like(by_index, -1)
    DeviceIds(at, ids, grid).place(by_grid)
    assert torch.equal(by_grid, by_index)
    assert by_index[list(at)].tolist() == ids.tolist() and int((by_index >= 0).sum()) == len(at)
