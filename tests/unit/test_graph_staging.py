"""The staging of a graph's inputs (engine/executor/staging.py) and the batches its captured
function builds from them, on the CPU (the graphs themselves are tested on the GPU in
tests/gpu): a plan staged into a bucket of more tokens and rows gives its real tokens the
batch an eager pass builds, its padding only the scratch row; an EAGLE round's draft steps
(`next_step`) built from such a padded feed write each real row's next positions."""

from __future__ import annotations

import torch

from infer.cache.factory import make_cache_pool
from infer.cache.forward_batch import ARRAYS, Row, batch_of, build_batch, next_step, plan_batch
from infer.engine.executor.staging import stage_sampling, plan_sizes, stage
from infer.models.config import ModelConfig

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TOKENS, ROWS, WIDTH = 16, 4, 64  # the bucket: tokens, rows, the graph's context width


class _Ring:
    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    def next_host(self) -> torch.Tensor:
        return self.host


def test_sampling_staging_rows_are_temperature_greedy_then_uniforms_per_step():
    host = torch.full((2 + 3, 4), -1.0, dtype=torch.float64)  # [2 + U, bucket]
    uniforms = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)  # [n, U]
    stage_sampling(_Ring(host), 2, [0.7, 1.0], [False, True], uniforms)
    assert host[:, :2].tolist() == [[0.7, 1.0], [0.0, 1.0], [0.1, 0.4], [0.2, 0.5], [0.3, 0.6]]
    assert (host[:, 2:] == -1).all()  # padding rows untouched


def _pool_and_plan():
    pool = make_cache_pool("paged", CFG, max_batch_size=4, max_seq_len=64, dtype=torch.float32, device="cpu",
                           block_size=4, num_blocks=40)
    slots = [pool.allocate_slot(n) for n in (9, 3, 17)]
    rows = [Row(slots[0], 9, [5, 6, 7]), Row(slots[1], 3, [8]), Row(slots[2], 17, [9, 10])]  # (a round's feed)
    for r in rows:
        assert pool.ensure_capacity(r.slot, r.start + len(r.ids) + 3)  # (room for three steps)
    return pool, plan_batch(rows)


def _staged(pool, plan):
    """The plan staged into a bucket buffer (filled with junk first, as a reused buffer is)."""
    sizes = plan_sizes(TOKENS, ROWS)
    buf = torch.full((sum(sizes),), 7, dtype=torch.long)
    parts = dict(zip(ARRAYS, torch.split(buf, sizes), strict=True))
    stage({name: part.numpy() for name, part in parts.items()}, plan)  # (views of buf)
    return batch_of(parts, pool.tables.sync(), pool.block_size, pool.scratch_row, (1,) * TOKENS, WIDTH, 0)


def test_a_staged_plan_gives_its_tokens_the_eager_batch_and_its_padding_the_scratch_row():
    pool, plan = _pool_and_plan()
    eager = build_batch(plan, pool.tables, pool.block_size, pool.scratch_row, "cpu")
    staged = _staged(pool, plan)
    n, b = plan.num_tokens, plan.num_rows
    for name in ("token_ids", "positions", "rope_positions", "slots", "token_rows"):
        assert torch.equal(getattr(staged, name)[:n], getattr(eager, name)), name
    assert torch.equal(staged.seq_lens[:b], eager.seq_lens) and (staged.seq_lens[b:] == 0).all()
    assert torch.equal(staged.block_tables[:b], eager.block_tables)
    assert torch.equal(staged.logits_indices[:b], eager.logits_indices)  # each row's last token
    assert (staged.positions[n:] == -1).all() and (staged.slots[n:] == pool.scratch_row).all()


def test_draft_steps_after_a_padded_feed_write_each_rows_next_positions():
    pool, plan = _pool_and_plan()
    eager = build_batch(plan, pool.tables, pool.block_size, pool.scratch_row, "cpu")
    staged = _staged(pool, plan)
    ids = torch.arange(ROWS) + 50
    for ahead in range(3):
        step = next_step(staged, ids, ahead, pool.scratch_row, WIDTH)
        real = next_step(eager, ids[:plan.num_rows], ahead, pool.scratch_row, WIDTH)
        for b, (slot, end) in enumerate(plan.ends):
            assert step.positions[b] == real.positions[b] == end + ahead
            assert step.seq_lens[b] == real.seq_lens[b] == end + ahead + 1
            assert step.slots[b] == real.slots[b] == int(pool.rows(slot, end + ahead, end + ahead + 1))
        assert (step.positions[plan.num_rows:] == -1).all() and (step.seq_lens[plan.num_rows:] == 0).all()
        assert (step.slots[plan.num_rows:] == pool.scratch_row).all()
        assert step.token_rows.tolist() == step.logits_indices.tolist() == list(range(ROWS))
        assert step.query_start.tolist() == list(range(ROWS + 1)) and step.tree is None
