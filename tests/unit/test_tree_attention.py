"""Tree attention through the KV pools (issue #37).

A tree chunk's logits equal plain forwards of each node's path, for the verification block
and for a draft's level-by-level chunks, on both pool layouts; `BlockMask` and `TreeChunk`
by hand; an accepted path's keys and values moved into sequence order (`cache.compaction`)
equal those of a plain prefill of the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from infer.cache.compaction import PathMove, move_paths, path_rows
from infer.cache.factory import make_cache_pool
from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout, BlockMask
from infer.engine.executor import ForwardFn, ForwardSpec, make_forward
from infer.models.attention import position_mask
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
    forward(torch.tensor([tokens]), BatchLayout.of([slot], [0], [len(tokens)]), all_logits=True)
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
    layout = BatchLayout.of(slots, [len(c) for c in contexts], [d.rows_used for d in drafts], width=16)
    ids = torch.tensor([[g[b], *drafts[b].token_ids] for b in range(2)])
    logits = forward.tree(ids, layout, TreeChunk.verification(SHAPE))  # [2, 16, V]
    assert logits.shape == (2, 16, 100)
    for b, ctx in enumerate(contexts):
        torch.testing.assert_close(logits[b, 0], last_logits(model, ctx + [g[b]]), atol=1e-5, rtol=0)
        for i in range(drafts[b].rows_used - 1):
            want = last_logits(model, ctx + [g[b]] + path_tokens(nodes[b], i))
            torch.testing.assert_close(logits[b, 1 + i], want, atol=1e-5, rtol=0)
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
        layout = BatchLayout.of([slot], [10 + lo], [hi - lo])
        logits = forward.tree(torch.tensor([nodes[lo:hi]]), layout, chunk)  # [1, width, V]
        for i in range(lo, hi):
            want = last_logits(model, ctx + [4] + path_tokens(nodes, i))
            torch.testing.assert_close(logits[0, i - lo], want, atol=1e-5, rtol=0)
        assert pool.seq_len(slot) == 10 + hi


def test_block_mask_by_hand():
    # tree "2": the block [g, a, b] at positions 5, 6, 7 of a 9-key context; a and b are siblings
    block = BlockMask(TreeChunk.verification(TreeShape((2,))).mask(), first_row=0)
    q_pos = torch.tensor([[5, 6, 7]])
    vis = position_mask(q_pos, torch.tensor([8]), 9) & block.visibility(q_pos, 9)  # [1, 3, 9]
    want = [[1, 1, 1, 1, 1, 1, 0, 0, 0],  # g: the context and itself
            [1, 1, 1, 1, 1, 1, 1, 0, 0],  # a: + itself
            [1, 1, 1, 1, 1, 1, 0, 1, 0]]  # b: not its sibling a
    assert vis[0].int().tolist() == want
    # the same rule for a level chunk: b alone, block row 2 at position 7
    level = BlockMask(TreeChunk.level(TreeShape((2,)), 1).mask()[1:], first_row=2)
    assert level.visibility(torch.tensor([[7]]), 9)[0, 0].int().tolist() == [1] * 6 + [0, 1, 1]


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
    forward.tree(torch.tensor([[7, *nodes]]), BatchLayout.of([slot], [n], [16]), TreeChunk.verification(SHAPE))
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
    out = forward(torch.tensor([[11]]), BatchLayout.of([slot], [n + 4], [1]), all_logits=False)
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
