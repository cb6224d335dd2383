"""Start-up cost calibration of the adaptive policy (engine/calibration.py): it measures the
batch sizes whose scratch slots fit the KV pool and gives every block back."""

from __future__ import annotations

import torch

from infer.cache.forward import EagerForward
from infer.cache.paged import PagedKVCachePool
from infer.engine.calibration import measure_costs
from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def _pool(num_blocks: int) -> tuple[EagerForward, PagedKVCachePool]:
    pool = PagedKVCachePool(CFG, 8, 128, torch.float32, "cpu", block_size=4, num_blocks=num_blocks)
    return EagerForward(LlamaForCausalLM(CFG), pool), pool


def test_calibration_measures_the_batches_that_fit_and_frees_its_slots():
    # scratch slots hold 32 context + up to k_max + 1 = 6 tokens: 10 blocks of 4 each, so
    # 24 blocks fit batches 1 and 2 but not 4 (of max_batch_size 8)
    forward, pool = _pool(24)
    model = measure_costs(forward, pool, None, None, CFG.vocab_size, 8, 5, repeats=1)
    assert sorted(model.verify_ratio) == [1, 2] and model.draft_ratio == {1: 0.0, 2: 0.0}
    assert all(len(v) == 6 and v[0] == 1.0 for v in model.verify_ratio.values())
    assert pool.free_token_capacity() == 24 * 4 and pool.leak_report() == []
    big = measure_costs(*_pool(80), None, None, CFG.vocab_size, 8, 5, repeats=1)
    assert sorted(big.verify_ratio) == [1, 2, 4, 8]


def test_calibration_with_no_room_leaves_the_defaults():
    forward, pool = _pool(9)  # not even one scratch slot of 38 tokens
    model = measure_costs(forward, pool, None, None, CFG.vocab_size, 8, 5, repeats=1)
    assert model.verify_ratio == {} and model.calibrated(1) == (0.5, [1.0] * 6)
    assert pool.free_token_capacity() == 9 * 4 and pool.leak_report() == []


def test_draft_cost_is_the_slope_between_whole_rounds(monkeypatch):
    # a round has a fixed part (host work, the final sync) paid once however many tokens it
    # drafts: c must be what one more token adds, not a lone step's time
    from infer.engine import calibration

    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])

    _, pool = _pool(40)

    class Draft:
        def draft_loop(self, ids, layout, steps, temperatures, uniforms, greedy):
            assert layout.chunk_lens == (steps,) * ids.shape[0]  # the union of the round's positions
            clock[0] += 1.0 + 0.25 * steps
            pool.commit(layout)  # as a real round: the pool ends committed to the union
            return torch.zeros((ids.shape[0], steps), dtype=torch.long), None

    assert calibration.draft_token_time(Draft(), pool, CFG.vocab_size, 1, 5, repeats=2) == 0.25
    assert calibration.draft_token_time(Draft(), pool, CFG.vocab_size, 1, 1, repeats=2) == 1.25
    assert pool.leak_report() == []


def test_calibration_with_a_draft_model_prices_its_tokens_and_frees_both_pools():
    forward, pool = _pool(80)
    draft, draft_pool = _pool(80)
    model = measure_costs(forward, pool, draft, draft_pool, CFG.vocab_size, 2, 3, repeats=1)
    assert sorted(model.draft_ratio) == [1, 2] and all(c > 0 for c in model.draft_ratio.values())
    assert pool.leak_report() == [] and draft_pool.leak_report() == []
    assert draft_pool.free_token_capacity() == 80 * 4


def test_a_slow_call_does_not_move_the_calibrated_time(monkeypatch):
    # each call is timed alone and the median kept: one call slowed by the host (preempted,
    # a garbage collection) must not price speculation for the engine's whole life
    from infer.engine import calibration

    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    costs = iter([9.0] + [1.0, 1.0, 50.0, 1.0, 1.0])  # warm-up, then the timed calls

    def call() -> None:
        clock[0] += next(costs)

    assert calibration._time(call, torch.device("cpu"), 5) == 1.0
