"""Mixed batches (`EngineConfig.mixed_batches`): plain decode rows and prefill chunks in one
packed forward give the same tokens as a forward each, in fewer target forwards.

Requests arrive staggered (one every other step), so new prompts' prefill chunks meet the
older requests' decode steps; both KV backends, prefix caching, tiny chunks, a pool small
enough to preempt, overlapped scheduling, seeded sampling, and speculation switched off by
batch size (its plain steps mix, its rounds keep their own forwards).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from infer import SamplingParams
from infer.cache.paged import PagedKVCachePool
from infer.cache.view import BatchLayout, pack_rows, pool_view, unpack_rows
from infer.engine.executor.forward import EagerForward
from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM

MAX_NEW = 8


class CountingForward:
    """Wraps a runner's forward function: counts target forwards and the packed ones."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls, self.packed = inner, 0, 0

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        self.calls += 1
        self.packed += layout.packed
        return self.inner(ids, layout, all_logits)

    def sample(self, ids: torch.Tensor, layout: BatchLayout, *args: Any) -> Any:
        self.calls += 1
        return self.inner.sample(ids, layout, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 90) for _ in range(12)]
    return [(shared if i % 2 else []) + [rng.randrange(2, 90) for _ in range(rng.randint(3, 20))]
            for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list[int]]:
    """Add a request every other step; returns each request's tokens and the target forwards
    of each step that had both prefill chunks and decode rows (checking that every step's
    decode tokens and chunks fit the token budget)."""
    budget = llm.engine.config.max_num_batched_tokens
    engine = llm.engine
    runner = engine.runner
    counters = [CountingForward(runner.forward), CountingForward(runner.prefill_forward)]
    runner.forward, runner.prefill_forward = counters
    requests, both, step = [], [], 0
    while len(requests) < len(prompts) or engine.has_unfinished():
        if step % 2 == 0 and len(requests) < len(prompts):
            requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
        before = sum(c.calls for c in counters)
        decision = engine.scheduler.schedule
        seen: list[Any] = []
        engine.scheduler.schedule = lambda: seen.append(decision()) or seen[-1]
        engine.step()
        engine.scheduler.schedule = decision
        assert not seen[0].prefill or len(seen[0].decode) + sum(n for _, n in seen[0].prefill) <= budget
        if seen[0].prefill and seen[0].decode:
            both.append(sum(c.calls for c in counters) - before)
        step += 1
    assert engine.leak_report() == []
    return [list(r.output_token_ids) for r in requests], both


CONFIGS = {
    "paged-prefix": dict(kv_cache_backend="paged", enable_prefix_caching=True, block_size=4),
    "contiguous": dict(kv_cache_backend="contiguous"),
    # decode rows' ids from the step in flight (read by the mixed forward on the device)
    "overlapped": dict(async_scheduling=True),
    "paged-chunks-preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=14, max_num_batched_tokens=9),
    "ngram-off-above-1": dict(use_speculative_decoding=True, speculative_method="ngram", spec_length=3,
                              spec_disable_batch_size=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixed_equals_separate_greedy(make_llm: Callable[..., Any], ckpt_a: Any, name: str) -> None:
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(prompts)
    kwargs = {"max_batch_size": 4, "max_seq_len": 64, **CONFIGS[name]}
    mixed = make_llm(ckpt_a, mixed_batches=True, **kwargs)
    got, both_mixed = _run(mixed, prompts, params)
    separate = make_llm(ckpt_a, mixed_batches=False, **kwargs)
    want, both_separate = _run(separate, prompts, params)
    assert got == want
    assert all(len(t) == MAX_NEW for t in got)
    assert both_mixed and min(both_mixed) == 1 and max(both_separate) == 2
    assert sum(both_mixed) < sum(both_separate)
    if "ngram" not in name:  # (a speculation round keeps its own forwards)
        assert max(both_mixed) == 1  # every step with both made one target forward
    assert mixed.engine.runner.prefill_forward.packed > 0
    if name == "paged-chunks-preempt":
        assert mixed.engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if name == "paged-prefix":
        assert mixed.engine.runner.cache_pool.prefix_hit_rate > 0


def test_mixed_equals_separate_seeded_sampling(make_llm: Callable[..., Any], ckpt_a: Any) -> None:
    prompts = _prompts(5, seed=9)
    params = [SamplingParams(temperature=t, top_p=p, max_tokens=MAX_NEW, ignore_eos=True, seed=40 + i)
              for i, (t, p) in enumerate([(0.8, 1.0), (1.0, 0.9), (0.0, 1.0), (1.2, 1.0), (1.0, 1.0)])]
    got, both = _run(make_llm(ckpt_a, max_batch_size=4, mixed_batches=True), prompts, params)
    want, _ = _run(make_llm(ckpt_a, max_batch_size=4, mixed_batches=False), prompts, params)
    assert both and max(both) == 1  # sampled rows rode along with prefill chunks
    assert got == want
    assert len({tuple(t) for t in got}) == len(got)  # the seeds really differ


def test_pack_rows_round_trip() -> None:
    layout = BatchLayout.of([0, 1, 2], [5, 0, 9], [1, 4, 2], packed=True)
    x = torch.arange(3 * 4).view(3, 4) + 1  # [B, T]
    packing = layout.packing("cpu")
    assert pack_rows(x, packing)[0].tolist() == [1, 5, 6, 7, 8, 9, 10]
    assert layout.last_token_indices("cpu").tolist() == [0, 4, 6]
    back = unpack_rows(pack_rows(x, packing), packing, 3, 4)
    assert back.tolist() == [[1, 0, 0, 0], [5, 6, 7, 8], [9, 10, 0, 0]]


@pytest.mark.parametrize("lens", [[1, 5, 1, 3], [4, 4, 4, 4]], ids=["groups", "dense"])
def test_packed_forward_equals_padded(lens: list[int]) -> None:
    # two decode rows (one token each) and two chunks of 5 and 3 tokens after cached prefixes,
    # or four chunks of 4 (one group that needs no padding: `RowGroup.dense`): the packed
    # forward's last-token logits and written K/V are the padded forward's
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    history = [7, 4, 9, 3]  # tokens each slot holds before the step
    ids = torch.randint(0, 100, (4, max(lens)))
    results = []
    for packed in (False, True):
        pool = PagedKVCachePool(cfg, 4, 32, torch.float32, "cpu", block_size=4, num_blocks=40)
        forward = EagerForward(model, pool)
        slots = [pool.allocate_slot(h + n) for h, n in zip(history, lens, strict=True)]
        torch.manual_seed(1)
        forward(torch.randint(0, 100, (4, max(history))), BatchLayout.of(slots, [0] * 4, history), all_logits=False)
        layout = BatchLayout.of(slots, history, lens, packed=packed)
        if packed:
            groups = pool_view(pool, layout).groups
            assert [g.dense for g in groups] == ([True] if len(set(lens)) == 1 else [False, False])
        with torch.inference_mode():
            logits = forward(ids, layout, all_logits=False)  # [4, V]
        rows = torch.cat([pool.rows(s, h, h + n) for s, h, n in zip(slots, history, lens, strict=True)])
        results.append((logits, pool.k_cache[:, rows], pool.v_cache[:, rows]))
        assert [pool.seq_len(s) for s in slots] == [h + n for h, n in zip(history, lens, strict=True)]
    for padded, packed in zip(*results, strict=True):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="last-token logits only"):
        EagerForward(model, pool)(ids, BatchLayout.of(slots, [0] * 4, lens, packed=True), all_logits=True)
