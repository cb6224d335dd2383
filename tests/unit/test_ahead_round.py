"""The rule both proposers apply to a round drafted ahead (`speculative/ahead.py`): which
rounds take it (`takes`), and what a drop leaves of the cache (`AheadRound.drop`: the draft
model's accepted positions, the EAGLE head's start; the blocks always kept).
The engine's rounds drafted ahead: tests/integration/test_draft_ahead.py, test_eagle_e2e.py."""

from __future__ import annotations

import pytest
import torch

from infer.cache.paged import PagedKVCachePool
from infer.models.config import ModelConfig
from infer.speculative.ahead import AheadRound, takes
from infer.speculative.draft_model import DraftAhead
from infer.speculative.eagle_state import AheadMark
from infer.speculative.node_tree import DynamicShape
from infer.speculative.tree import RoundTokens, TreeShape, chain_shape

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)
STEPS, START = 3, 10  # the round ahead's drafts; the computed tokens when the round it follows began


def mark(accepted: int | None = None, cls: type[AheadRound] = AheadRound, **extra: object) -> AheadRound:
    m = cls(RoundTokens(torch.zeros((2, STEPS), dtype=torch.long)), 1, STEPS, START, **extra)  # type: ignore[arg-type]
    m.accepted = accepted
    return m


@pytest.mark.parametrize("k, computed, want", [
    (STEPS, START + 2, True),  # one draft accepted: the next round starts at START + 2
    (1, START + 2, True),  # a shorter chain takes the first drafts
    (STEPS + 1, START + 2, False),  # longer than drafted ahead
    (0, START + 2, False),  # no round
    (STEPS, START + 3, False),  # not right after the round it follows
])
def test_a_verified_round_is_taken_by_a_chain_of_at_most_its_steps_right_after_it(k, computed, want) -> None:
    m = mark(accepted=1)
    assert takes(m, chain_shape(STEPS + 2), k, computed) is want
    assert takes(m, chain_shape(STEPS + 2), k, computed, in_flight=True) is want  # (verified: nothing in flight)


def test_trees_and_shallower_shapes_drop_it() -> None:
    m = mark(accepted=STEPS)
    after = START + STEPS + 1
    assert takes(m, chain_shape(STEPS), STEPS, after)
    assert not takes(m, chain_shape(STEPS - 1), STEPS, after)  # (k past the shape's depth)
    assert not takes(m, TreeShape((2, 1, 1)), STEPS, after)
    assert not takes(m, DynamicShape(nodes=8, branch=2, depth=STEPS), STEPS, after)


def test_a_round_in_flight_is_taken_only_by_a_proposer_that_follows_it() -> None:
    m = mark()  # (its verdict unread: the host counts every draft accepted)
    after = START + STEPS + 1
    assert m.follows_in_flight(STEPS, after)
    assert takes(m, chain_shape(STEPS), STEPS, after, in_flight=True)
    assert not takes(m, chain_shape(STEPS), STEPS, after)
    assert not takes(m, chain_shape(STEPS), STEPS - 1, after, in_flight=True)  # (its steps exactly)
    assert not takes(m, chain_shape(STEPS), STEPS, after - 1, in_flight=True)


@pytest.mark.parametrize("accepted", [None, 0, 2])
def test_a_drop_leaves_the_kept_positions_and_every_block(accepted) -> None:
    pool = PagedKVCachePool(CFG, 2, 64, torch.float32, "cpu", block_size=4, num_blocks=16)
    draft, head = pool.allocate_slot(0), pool.allocate_slot(0)
    for slot in (draft, head):  # (the round ahead wrote up to 2 * STEPS past START)
        assert pool.ensure_capacity(slot, START + 2 * STEPS + 1)
        pool.set_length(slot, START + 2 * STEPS + 1)
    tables = [pool.block_table(s) for s in (draft, head)]
    mark(accepted, DraftAhead, probs=None).drop(pool, draft)
    mark(accepted, AheadMark, features=torch.zeros(2 * (STEPS + 1), 4), counts=torch.zeros(2)).drop(pool, head)
    # the draft model keeps the verdict's positions (its catch-up feeds tokens from its cache's
    # end), the head only those before START (the accepted positions' features come back pending)
    assert pool.seq_len(draft) == (START if accepted is None else START + accepted + 1)
    assert pool.seq_len(head) == START
    assert [pool.block_table(s) for s in (draft, head)] == tables


def test_a_drop_never_lengthens_the_cache() -> None:
    pool = PagedKVCachePool(CFG, 1, 64, torch.float32, "cpu", block_size=4, num_blocks=16)
    slot = pool.allocate_slot(START)
    pool.set_length(slot, START - 1)
    mark(accepted=2, cls=DraftAhead, probs=None).drop(pool, slot)
    assert pool.seq_len(slot) == START - 1
