"""PagedKVCachePool: block accounting, prefix reuse, rollback, and logits equal to a
no-cache forward through prefill, chunked prefill, decode and cached prefixes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from infer.cache.paged import PagedKVCachePool, bytes_per_block
from infer.cache.forward_batch import Row, plan_batch
from infer.engine.executor.batch_forward import EagerBatchForward
from infer.models.config import ModelConfig
from infer.models.kernels.arrivals import MIN_COUNTERS
from infer.models.llama import LlamaForCausalLM

CFG = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16)
BS = 4


def make_pool(num_blocks: int = 16, prefix: bool = True, batch: int = 4, block_size: int = BS,
              max_seq_len: int = 64) -> PagedKVCachePool:
    return PagedKVCachePool(CFG, batch, max_seq_len, torch.float32, "cpu", block_size=block_size,
                            num_blocks=num_blocks, enable_prefix_caching=prefix)


def fill(pool: PagedKVCachePool, slot: int, end: int) -> None:
    """Advance the slot's length to `end` as a forward pass would (no model needed)."""
    assert pool.ensure_capacity(slot, end)
    pool.set_length(slot, end)


def prefill(pool: PagedKVCachePool, prompt: list[int]) -> int:
    slot = pool.allocate_slot(len(prompt), prompt)
    fill(pool, slot, len(prompt))
    pool.register_prefix(slot, prompt)
    return slot


# -- construction ----------------------------------------------------------------------
def test_num_blocks_from_default_budget_and_argument() -> None:
    pool = PagedKVCachePool(CFG, 3, 50, torch.float32, "cpu", block_size=16)
    assert pool.num_blocks == 3 * 4  # ceil(50 / 16) blocks per sequence
    assert pool.k_cache.shape == (2, 12 * 16 + 1, 2, 16) and pool.v_cache.shape == pool.k_cache.shape  # + scratch row
    per_block = 2 * 2 * 16 * 2 * 16 * 2  # k+v, layers, block, heads, dim, bf16 bytes
    assert bytes_per_block(CFG, 16, torch.bfloat16) == per_block
    budget = PagedKVCachePool(CFG, 3, 50, torch.bfloat16, "cpu", block_size=16,
                              memory_budget_bytes=7 * per_block + 5)
    assert budget.num_blocks == 7
    assert make_pool(num_blocks=9).num_blocks == 9


def test_each_pool_keeps_its_own_arrival_counters_and_every_set_it_made() -> None:
    first, second = make_pool(), make_pool()
    counters = first.arrivals.take(10)  # [MIN_COUNTERS] int32, zero between launches
    assert counters.numel() == MIN_COUNTERS and counters.dtype == torch.int32 and not counters.any()
    assert first.arrivals.take(MIN_COUNTERS) is counters  # every pass over the pool: one set
    assert second.arrivals.take(10) is not counters  # another pool's passes: another set
    larger = first.arrivals.take(MIN_COUNTERS + 1)
    assert larger is not counters and larger.numel() == MIN_COUNTERS + 1 and first.arrivals.take(1) is larger
    kept = weakref.ref(counters)
    del counters
    gc.collect()
    assert kept() is not None  # the smaller set stays: a graph captured before may read it


@pytest.mark.parametrize("kwargs, name", [
    ({"num_blocks": 0}, "num_blocks"),
    ({"memory_budget_bytes": 10}, "memory_budget_bytes"),
    ({"num_blocks": 4, "memory_budget_bytes": 10**9}, "not both"),
    ({"block_size": 0}, "block_size"),
])
def test_bad_parameters_raise_value_error(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PagedKVCachePool(CFG, 2, 32, torch.float32, "cpu", **kwargs)


# -- allocation ------------------------------------------------------------------------
def test_allocate_reserves_blocks_and_fails_cleanly_when_short() -> None:
    pool = make_pool(num_blocks=5)
    slot = pool.allocate_slot(9)  # 3 blocks
    assert pool.seq_len(slot) == 0 and len(set(pool.block_table(slot))) == 3
    assert pool.num_free_blocks == 2 and pool.free_token_capacity() == 2 * BS
    assert pool.can_allocate(8) and not pool.can_allocate(9)
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        pool.allocate_slot(9)
    assert pool.num_free_blocks == 2 and pool.num_free_slots == 3  # nothing taken
    with pytest.raises(RuntimeError, match="max_seq_len"):
        pool.allocate_slot(65)


def test_ensure_capacity_false_when_exhausted_true_after_freeing() -> None:
    pool = make_pool(num_blocks=4, prefix=False)
    a, b = pool.allocate_slot(8), pool.allocate_slot(4)
    assert pool.ensure_capacity(a, 12) and pool.num_free_blocks == 0
    assert not pool.ensure_capacity(b, 5)
    assert len(pool.block_table(b)) == 1  # nothing half-allocated
    pool.free_slot(a)
    assert pool.ensure_capacity(b, 16) and len(pool.block_table(b)) == 4


def test_rows_follow_the_block_table() -> None:
    pool = make_pool(num_blocks=8, prefix=False)
    a, b = pool.allocate_slot(3), pool.allocate_slot(3)
    assert pool.ensure_capacity(a, 10)  # a's blocks interleave with b's
    table = pool.block_table(a)
    expected = [table[p // BS] * BS + p % BS for p in range(10)]
    assert pool.rows(a, 0, 10).tolist() == expected
    assert pool.rows(a, 5, 10).tolist() == expected[5:]
    assert not set(pool.rows(b, 0, 3).tolist()) & set(expected)


# -- truncation ------------------------------------------------------------------------
def test_truncate_frees_exactly_the_blocks_past_the_new_length() -> None:
    pool = make_pool(num_blocks=10, prefix=False)
    slot = pool.allocate_slot(3)
    fill(pool, slot, 21)  # 6 blocks (last one partial)
    table, free_before = pool.block_table(slot), pool.num_free_blocks
    pool.truncate_to(slot, 9)  # keeps ceil(9 / 4) = 3 blocks, the partial third included
    assert pool.seq_len(slot) == 9 and pool.block_table(slot) == table[:3]
    assert pool.num_free_blocks == free_before + 3
    assert all(pool.is_block_free(b) for b in table[3:]) and not any(pool.is_block_free(b) for b in table[:3])
    pool.truncate_to(slot, 8)  # block boundary: the third block goes too
    assert pool.block_table(slot) == table[:2] and pool.is_block_free(table[2])
    pool.truncate_to(slot, 8)
    assert pool.block_table(slot) == table[:2]
    with pytest.raises(ValueError, match="outside"):
        pool.truncate_to(slot, 9)


def test_truncate_never_frees_or_enters_prefix_blocks() -> None:
    pool = make_pool()
    prompt = list(range(10))
    a = prefill(pool, prompt)  # blocks 0, 1 full and cached; block 2 partial, private
    assert pool.num_shared_blocks(a) == 2 and pool.num_cached_blocks == 2
    fill(pool, a, 15)
    shared = pool.block_table(a)[:2]
    pool.truncate_to(a, 8)
    assert pool.block_table(a) == shared and not any(pool.is_block_free(b) for b in shared)
    with pytest.raises(RuntimeError, match="shared prefix"):
        pool.truncate_to(a, 7)
    assert pool.seq_len(a) == 8 and pool.block_table(a) == shared


# -- prefix caching --------------------------------------------------------------------
def test_second_request_reuses_shared_full_blocks() -> None:
    pool = make_pool()
    prompt = list(range(11))
    a = prefill(pool, prompt)
    b = pool.allocate_slot(13, prompt[:10] + [50, 51, 52])
    assert pool.seq_len(b) == 8  # two full blocks of the shared 10 tokens
    assert pool.block_table(b)[:2] == pool.block_table(a)[:2]  # same storage rows
    assert pool.rows(b, 0, 8).tolist() == pool.rows(a, 0, 8).tolist()
    assert pool.block_table(b)[2] not in pool.block_table(a)
    assert pool.prefix_hit_tokens == 8 and pool.prefix_query_tokens == 11 + 13
    assert pool.prefix_hit_rate == pytest.approx(8 / 24)
    pool.free_slot(a)
    pool.free_slot(b)
    assert pool.leak_report() == []


def test_no_reuse_after_a_differing_token() -> None:
    pool = make_pool()
    prompt = list(range(13))
    prefill(pool, prompt)
    changed = prompt.copy()
    changed[5] = 99
    b = pool.allocate_slot(13, changed)
    assert pool.seq_len(b) == 4  # only the block before the difference
    c = pool.allocate_slot(13, [99] + prompt[1:])
    assert pool.seq_len(c) == 0


def test_whole_prompt_is_never_reused() -> None:
    pool = make_pool()
    prompt = list(range(8))  # exactly two blocks
    prefill(pool, prompt)
    b = pool.allocate_slot(8, prompt)
    assert pool.seq_len(b) == 4  # the last token (and so its block) is computed again
    c = pool.allocate_slot(9, prompt + [42])
    assert pool.seq_len(c) == 8
    assert pool.allocate_slot(1, prompt[:1]) is not None


def test_a_hit_is_cut_to_max_cached_tokens() -> None:
    pool = make_pool(batch=5)
    prompt = list(range(13))
    prefill(pool, prompt)
    assert pool.cached_prefix(prompt) == 12 and pool.cached_prefix(prompt[:12]) == 8
    hits = pool.prefix_hit_tokens
    assert [pool.seq_len(pool.allocate_slot(13, prompt, limit)) for limit in (12, 11, 4, 3)] == [12, 8, 4, 0]
    assert pool.prefix_hit_tokens - hits == 24 and pool.cached_prefix(prompt) == 12  # (nothing taken by asking)


def test_lookahead_blocks_are_cached_once_the_token_after_them_is_known() -> None:
    # an EAGLE head's pool: block b holds entries built from tokens up to (b + 1) * BS
    pool = make_pool(prefix=False)
    pool.cache_prefixes(lookahead=1)
    prompt = list(range(13))
    a = prefill(pool, prompt[:12])
    assert pool.num_cached_blocks == 2  # block 2's next token is not in the prompt given
    pool.register_prefix(a, prompt)
    assert pool.num_cached_blocks == 3
    assert pool.cached_prefix(prompt) == 12 and pool.cached_prefix(prompt[:12]) == 8
    assert pool.cached_prefix(prompt[:8] + [99, 9, 10]) == 4  # block 1 followed by another token
    b = pool.allocate_slot(9, prompt[:9])
    assert pool.seq_len(b) == 8 and pool.block_table(b)[:2] == pool.block_table(a)[:2]
    pool.cache_prefixes(lookahead=1)  # (again: nothing changes)
    with pytest.raises(RuntimeError, match="idle pool"):
        pool.cache_prefixes(lookahead=0)
    pool.free_slot(a)
    pool.free_slot(b)
    assert pool.leak_report() == [] and pool.num_cached_blocks == 3


def test_prefix_caching_off_reuses_nothing() -> None:
    pool = make_pool(prefix=False)
    prompt = list(range(12))
    prefill(pool, prompt)
    assert pool.num_cached_blocks == 0
    assert pool.seq_len(pool.allocate_slot(12, prompt)) == 0


def test_free_keeps_cached_blocks_and_refcounts_are_exact() -> None:
    pool = make_pool(num_blocks=12)
    prompt = list(range(9))
    a = prefill(pool, prompt)
    b = pool.allocate_slot(9, prompt)
    shared = pool.block_table(a)[:2]
    assert [pool._tree.refcount(x) for x in shared] == [2, 2]
    pool.free_slot(a)
    assert [pool._tree.refcount(x) for x in shared] == [1, 1] and pool.num_evictable_blocks == 0
    pool.free_slot(b)
    assert pool.num_cached_blocks == 2 and pool.num_evictable_blocks == 2
    assert not any(pool.is_block_free(x) for x in shared)
    assert pool.num_free_blocks == 10 and pool.free_token_capacity() == 12 * BS
    assert pool.leak_report() == []


def test_concurrent_duplicate_prompt_is_deduplicated() -> None:
    pool = make_pool(num_blocks=12)
    prompt = list(range(9))
    a = pool.allocate_slot(9, prompt)
    b = pool.allocate_slot(9, prompt)  # nothing cached yet: both compute the prompt
    fill(pool, a, 9)
    fill(pool, b, 9)
    b_own = pool.block_table(b)[:2]
    pool.register_prefix(a, prompt)
    pool.register_prefix(b, prompt)
    assert pool.num_cached_blocks == 2
    assert pool.block_table(b)[:2] == pool.block_table(a)[:2]  # b switched to the cached copy
    assert all(pool.is_block_free(x) for x in b_own)
    assert pool.leak_report() == [f"slot {a} still allocated (9 tokens, 3 blocks)",
                                  f"slot {b} still allocated (9 tokens, 3 blocks)"]
    pool.free_slot(a)
    pool.free_slot(b)
    assert pool.leak_report() == [] and pool.num_evictable_blocks == 2


def test_register_only_covers_computed_full_blocks() -> None:
    pool = make_pool()
    prompt = list(range(11))
    slot = pool.allocate_slot(11, prompt)
    fill(pool, slot, 6)  # chunked prefill half done
    pool.register_prefix(slot, prompt)
    assert pool.num_cached_blocks == 1  # only block 0 is full and computed
    fill(pool, slot, 11)
    pool.register_prefix(slot, prompt)
    assert pool.num_cached_blocks == 2 and pool.num_shared_blocks(slot) == 2


def test_unreferenced_cached_blocks_are_evicted_lru_and_referenced_never() -> None:
    pool = make_pool(num_blocks=6)
    old, new = list(range(0, 9)), list(range(100, 109))
    a = prefill(pool, old)
    pool.free_slot(a)
    b = prefill(pool, new)
    pool.free_slot(b)
    keep = pool.allocate_slot(9, new)  # holds new's two blocks again
    assert pool.num_free_blocks == 1 and pool.num_evictable_blocks == 2  # old's two
    assert pool.can_allocate(12) and not pool.can_allocate(13)
    c = pool.allocate_slot(12)  # evicts old's two blocks, the least recently used
    assert pool.num_cached_blocks == 2 and pool.num_evictable_blocks == 0 and pool.num_free_blocks == 0
    assert not pool.ensure_capacity(c, 16)  # referenced cached blocks are never taken
    pool.free_slot(c)
    assert pool.seq_len(pool.allocate_slot(1, old)) == 0  # old was evicted
    assert pool.seq_len(pool.allocate_slot(9, new)) == 8  # new survived
    pool.free_slot(keep)
    assert pool.num_cached_blocks == 2


def test_leak_report_flags_held_slots_and_lost_blocks() -> None:
    pool = make_pool()
    assert pool.leak_report() == []
    slot = prefill(pool, list(range(9)))
    assert pool.leak_report() == [f"slot {slot} still allocated (9 tokens, 3 blocks)"]
    pool.free_slot(slot)
    assert pool.leak_report() == []
    pool._allocator.take(1)  # a block lost from every book
    assert any("neither free" in p for p in pool.leak_report())


def test_random_operations_keep_the_books_balanced() -> None:
    rng = torch.Generator().manual_seed(7)
    pool = make_pool(num_blocks=14, batch=4)
    stems = [list(range(s * 50, s * 50 + 12)) for s in range(3)]

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=rng))

    live: dict[int, list[int]] = {}
    for _ in range(300):
        op = pick(4)
        if op == 0 and pool.num_free_slots:
            prompt = stems[pick(3)][:4 + pick(9)] + [1000 + pick(5) for _ in range(pick(4))]
            if pool.can_allocate(len(prompt)):
                slot = pool.allocate_slot(len(prompt), prompt)
                fill(pool, slot, len(prompt))
                pool.register_prefix(slot, prompt)
                live[slot] = prompt
        elif op == 1 and live:
            slot = list(live)[pick(len(live))]
            end = min(pool.seq_len(slot) + 1 + pick(6), 64)
            if pool.ensure_capacity(slot, end):
                fill(pool, slot, end)
        elif op == 2 and live:
            slot = list(live)[pick(len(live))]
            floor = max(len(live[slot]), pool.num_shared_blocks(slot) * BS)
            pool.truncate_to(slot, floor + pick(pool.seq_len(slot) - floor + 1))
        elif op == 3 and live:
            slot = list(live)[pick(len(live))]
            pool.free_slot(slot)
            del live[slot]
        problems = [p for p in pool.leak_report() if "still allocated" not in p]
        assert problems == []
        assert pool.num_free_blocks + pool.num_evictable_blocks <= pool.num_blocks
        for slot in live:  # the rows kept per slot follow every change of its table
            table, n = pool.block_table(slot), pool.seq_len(slot)
            assert pool.rows(slot, 0, n).tolist() == [table[p // BS] * BS + p % BS for p in range(n)]
    for slot in list(live):
        pool.free_slot(slot)
    assert pool.leak_report() == [] and pool.prefix_hit_tokens > 0


# -- model-level equality -------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG).eval()


def run_chunks(model: LlamaForCausalLM, pool: PagedKVCachePool, slot: int, ids: torch.Tensor,
               cuts: list[int]) -> torch.Tensor:
    """Feed ids[seq_len(slot):] in chunks ending at cuts, a flat row each; logits of the fed
    tokens [1, n, V]."""
    forward, outs = EagerBatchForward(model, pool), []
    for end in cuts:
        start = pool.seq_len(slot)
        assert pool.ensure_capacity(slot, end)
        outs.append(forward.run(plan_batch([Row(slot, start, ids[0, start:end].tolist(), logits=end - start)])))
    return torch.cat(outs)[None]


@pytest.mark.parametrize("block_size", [16, 5, 1])
@torch.no_grad()
def test_prefill_chunks_and_decode_match_full_forward(model: LlamaForCausalLM, block_size: int) -> None:
    ids = torch.randint(0, CFG.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    full = model(ids)  # [1, 23, V]
    pool = make_pool(num_blocks=64, block_size=block_size)
    other = pool.allocate_slot(7)  # interleave another sequence's blocks
    slot = pool.allocate_slot(11)
    assert pool.ensure_capacity(other, 30)
    got = run_chunks(model, pool, slot, ids, [11, 18, 19, 20, 21, 22, 23])
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    # Roll back 3 positions (speculative rejection) and recompute them.
    pool.truncate_to(slot, 20)
    again = run_chunks(model, pool, slot, ids, [23])
    torch.testing.assert_close(again, full[:, 20:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_rows_of_two_lengths_in_one_pass_then_decode(model: LlamaForCausalLM) -> None:
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, CFG.vocab_size, (1, n), generator=gen) for n in (13, 6)]
    pool = make_pool(num_blocks=32, block_size=5)
    slots = [pool.allocate_slot(n) for n in (11, 4)]
    forward = EagerBatchForward(model, pool)
    lens = [11, 4]
    first = forward.run(plan_batch([Row(s, 0, seq[0, :n].tolist(), logits=n) for s, seq, n in zip(slots, seqs, lens)]))
    torch.testing.assert_close(first[:11], model(seqs[0][:, :11])[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(first[11:], model(seqs[1][:, :4])[0], atol=1e-5, rtol=0)
    for _ in range(2):
        pos = [pool.seq_len(s) for s in slots]
        assert all(pool.ensure_capacity(s, p + 1) for s, p in zip(slots, pos))
        out = forward.run(plan_batch([Row(s, p, [int(seq[0, p])]) for s, seq, p in zip(slots, seqs, pos)]))
        for b, p in enumerate(pos):
            torch.testing.assert_close(out[b], model(seqs[b][:, :p + 1])[0, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("free_first", [False, True])
@torch.no_grad()
def test_cached_prefix_gives_the_same_logits(model: LlamaForCausalLM, free_first: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, CFG.vocab_size, (1, 14), generator=gen)
    first = torch.cat([shared, torch.randint(0, CFG.vocab_size, (1, 3), generator=gen)], dim=1)
    second = torch.cat([shared, torch.randint(0, CFG.vocab_size, (1, 5), generator=gen)], dim=1)
    pool = make_pool(num_blocks=32, block_size=4)
    a = pool.allocate_slot(17, first[0].tolist())
    run_chunks(model, pool, a, first, [17])
    pool.register_prefix(a, first[0].tolist())
    if free_first:
        pool.free_slot(a)
    b = pool.allocate_slot(19, second[0].tolist())
    assert pool.seq_len(b) == 12  # three full blocks of the 14 shared tokens
    got = run_chunks(model, pool, b, second, [16, 19])
    torch.testing.assert_close(got, model(second)[:, 12:], atol=1e-5, rtol=0)
    if not free_first:
        pool.free_slot(a)
    pool.free_slot(b)
    assert pool.leak_report() == []
