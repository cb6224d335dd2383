"""Tree attention through the KV pools (issue #37).

A tree chunk's logits, run as flat batch rows with the chunk's rule (`TreeChunk.rule`),
equal plain forwards of each node's path, for the verification block and for a draft's
level-by-level chunks, on both pool layouts; the rules and `TreeChunk` by hand; an accepted path's keys and values moved into sequence order (`cache.compaction`)
equal those of a plain prefill of the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from infer.cache.compaction import PathMove, move_paths, path_rows
from infer.cache.factory import make_cache_pool
from infer.cache.protocol import CachePoolProtocol
from infer.cache.forward_batch import Row, plan_batch
from infer.engine.executor import ForwardFn, ForwardSpec, make_forward
from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM
from infer.speculative.tree import TreeChunk, Draft, TreeShape, cut_depth

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16)
SHAPE = TreeShape((3, 2, 1))  # depth 1: nodes 0-2; depth 2: 3-8; depth 3: 9-14
BACKENDS = ["paged", "contiguous"]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval()


def make_pool(backend: str) -> CachePoolProtocol:
    kwargs: dict = dict(max_batch_size=3, max_seq_len=64, dtype=torch.float32, device="cpu")
    if backend == "paged":
        kwargs.update(block_size=4, num_blocks=48, enable_prefix_caching=False)
    return make_cache_pool(backend, CFG, **kwargs)


def prefill(forward: ForwardFn, pool: CachePoolProtocol, tokens: list[int]) -> int:
    slot = pool.allocate_slot(len(tokens))
    forward.run(plan_batch([Row(slot, 0, tokens, len(tokens))]))
    return slot


def path_tokens(nodes: list[int], node: int) -> list[int]:
    return [nodes[j] for j in SHAPE.paths[node]]


def last_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]))[0, -1]


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_verification_block_equals_each_paths_plain_forward(model, backend):
    pool, gen = make_pool(backend), torch.Generator().manual_seed(1)
    forward = make_forward(model, pool, ForwardSpec())
    contexts = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in (7, 12)]
    slots = [prefill(forward, pool, ctx) for ctx in contexts]
    g = [5, 9]
    nodes = [torch.randint(0, 100, (SHAPE.num_nodes,), generator=gen).tolist() for _ in contexts]
    # row 1 is cut at depth 2 (a length guard): its last 6 block rows are padding
    drafts = [Draft(SHAPE, tuple(nodes[0]), (True,) * 15),
              cut_depth(Draft(SHAPE, tuple(nodes[1]), (True,) * 15), 2)]
    assert [d.rows_used for d in drafts] == [16, 10] and [d.depth for d in drafts] == [3, 2]
    for slot, ctx in zip(slots, contexts):
        assert pool.ensure_capacity(slot, len(ctx) + 16)
    chunk = TreeChunk.verification(SHAPE)
    rows = [Row(slot, len(ctx), [g[b], *d.token_ids][:d.rows_used], d.rows_used, chunk.rule(d.rows_used))
            for b, (slot, ctx, d) in enumerate(zip(slots, contexts, drafts))]
    logits = forward.run(plan_batch(rows)).split([d.rows_used for d in drafts])  # [rows_used, V] each
    for b, ctx in enumerate(contexts):
        assert logits[b].shape == (drafts[b].rows_used, 100)
        torch.testing.assert_close(logits[b][0], last_logits(model, ctx + [g[b]]), atol=1e-5, rtol=0)
        for i in range(drafts[b].rows_used - 1):
            want = last_logits(model, ctx + [g[b]] + path_tokens(nodes[b], i))
            torch.testing.assert_close(logits[b][1 + i], want, atol=1e-5, rtol=0)
        assert pool.seq_len(slots[b]) == len(ctx) + drafts[b].rows_used


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_level_chunks_equal_each_paths_plain_forward(model, backend):
    # a draft model's expansion: g first, then one chunk per depth at n + 1 + level_starts[d - 1]
    pool, gen = make_pool(backend), torch.Generator().manual_seed(2)
    forward = make_forward(model, pool, ForwardSpec())
    ctx = torch.randint(0, 100, (9,), generator=gen).tolist()
    nodes = torch.randint(0, 100, (SHAPE.num_nodes,), generator=gen).tolist()
    slot = prefill(forward, pool, ctx + [4])  # the context, then g at n = 9
    assert pool.ensure_capacity(slot, 9 + 16)
    for d in range(1, SHAPE.depth + 1):
        chunk = TreeChunk.level(SHAPE, d)
        lo, hi = SHAPE.level_starts[d - 1], SHAPE.level_starts[d]
        assert (chunk.first_row, chunk.width) == (1 + lo, hi - lo)
        logits = forward.run(plan_batch([Row(slot, 10 + lo, nodes[lo:hi], hi - lo, chunk.rule())]))  # [width, V]
        for i in range(lo, hi):
            want = last_logits(model, ctx + [4] + path_tokens(nodes, i))
            torch.testing.assert_close(logits[i - lo], want, atol=1e-5, rtol=0)
        assert pool.seq_len(slot) == 10 + hi


def test_tree_rules_by_hand():
    # tree "2": the block [g, a, b]; a and b are siblings: bit c of a row's rule is block row c
    full = TreeChunk.verification(TreeShape((2,))).rule()
    assert list(full.bits) == [0b001, 0b011, 0b101] and list(full.rope_offsets) == [0, 1, 1]
    assert (full.base_offset, full.width) == (0, 3)
    # a level chunk: a and b alone, stored from block row 1 (g precedes the row by one position)
    level = TreeChunk.level(TreeShape((2,)), 1).rule()
    assert list(level.bits) == [0b011, 0b101] and list(level.rope_offsets) == [1, 1]
    assert (level.base_offset, level.width) == (-1, 3)
    assert list(TreeChunk.verification(SHAPE).rule(4).bits) == [0b1, 0b11, 0b101, 0b1001]  # its first rows


def test_tree_chunk_rows_and_positions():
    chunk = TreeChunk.level(SHAPE, 2)
    assert (chunk.first_row, chunk.width) == (4, 6)
    assert chunk.rotary_offsets().tolist() == [2 - 4] * 6  # position n + 2, stored from n + 4
    assert chunk.mask().shape == (6, 16) and chunk.mask()[0].nonzero().flatten().tolist() == [0, 1, 4]
    full = TreeChunk.verification(SHAPE)
    assert full.rotary_offsets().tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    for bad in (dict(first_row=0, width=17), dict(first_row=-1, width=2), dict(first_row=3, width=0)):
        with pytest.raises(ValueError, match="block rows"):
            TreeChunk(SHAPE, **bad)
    with pytest.raises(ValueError, match="depth"):
        TreeChunk.level(SHAPE, 4)


def test_cut_depth_and_draft_extent():
    draft = Draft(SHAPE, tuple(range(1, 16)), (True,) * 15)
    cut = cut_depth(draft, 1)
    assert cut.valid == (True,) * 3 + (False,) * 12 and cut.token_ids[3:] == (0,) * 12
    assert (cut.depth, cut.rows_used, cut.num_proposed) == (1, 4, 3)
    assert cut_depth(draft, 3) is draft and cut_depth(draft, 0) == Draft.empty(SHAPE)
    assert (Draft.empty(SHAPE).depth, Draft.empty(SHAPE).rows_used) == (0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_accepted_path_moves_into_sequence_order(model, backend):
    pool, gen = make_pool(backend), torch.Generator().manual_seed(3)
    forward = make_forward(model, pool, ForwardSpec())
    ctx = torch.randint(0, 100, (10,), generator=gen).tolist()
    nodes = torch.randint(0, 100, (SHAPE.num_nodes,), generator=gen).tolist()
    slot = prefill(forward, pool, ctx)
    n = len(ctx)
    assert pool.ensure_capacity(slot, n + 16)
    forward.run(plan_batch([Row(slot, n, [7, *nodes], 16, TreeChunk.verification(SHAPE).rule())]))
    path = (2, 8, 14)  # the last child at every depth: every node moves
    assert move_paths(pool, [PathMove(slot, n, path)]) == 3
    pool.truncate_to(slot, n + 4)
    accepted = ctx + [7] + [nodes[i] for i in path]
    reference = make_pool(backend)
    ref_slot = prefill(make_forward(model, reference, ForwardSpec()), reference, accepted)
    rows, ref_rows = pool.rows(slot, 0, n + 4), reference.rows(ref_slot, 0, n + 4)
    for mine, theirs in ((pool.k_cache, reference.k_cache), (pool.v_cache, reference.v_cache)):
        torch.testing.assert_close(mine[:, rows], theirs[:, ref_rows], atol=1e-5, rtol=0)
    # the next step reads the moved rows: its logits are the plain model's
    assert pool.ensure_capacity(slot, n + 5)
    out = forward.run(plan_batch([Row(slot, n + 4, [11])]))
    torch.testing.assert_close(out[0], last_logits(model, accepted + [11]), atol=1e-5, rtol=0)


def test_paths_in_place_are_not_copied_and_bad_paths_are_refused():
    pool = make_pool("contiguous")
    slot = pool.allocate_slot(30)
    chain = PathMove(slot, 4, (0, 1, 2))  # node i_d == d - 1 at every depth (a chain): in place
    assert path_rows(pool, [chain]) == ([], [])
    src, dst = path_rows(pool, [PathMove(slot, 4, (0, 3, 9))])  # first children of tree "3,2,1"
    assert (src, dst) == (pool.rows(slot, 8, 15).tolist()[::6], pool.rows(slot, 6, 8).tolist())
    src, dst = path_rows(pool, [PathMove(slot, 4, (1,)), PathMove(slot, 4, ())])
    assert (src, dst) == ([pool.rows(slot, 6, 7).item()], [pool.rows(slot, 5, 6).item()])
    with pytest.raises(ValueError, match="accepted path"):
        PathMove(slot, 4, (0, 0))
