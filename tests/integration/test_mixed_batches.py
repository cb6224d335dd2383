"""Mixed batches (`EngineConfig.mixed_batches`): decode rows and prefill chunks in one flat
forward give the same tokens as a forward each, in fewer target forwards.

Requests arrive staggered (one every other step), so new prompts' prefill chunks meet the
older requests' decode steps; both KV backends, prefix caching, tiny chunks, a pool small
enough to preempt, overlapped scheduling, seeded sampling, and speculation switched off by
batch size (its plain steps and its rounds alike mix with prefill chunks). A verification
step larger than the token budget runs whole, and leaves prefill chunks their share (a
decode row counts one token).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from infer import SamplingParams

MAX_NEW = 8


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
    calls = [0]
    forward = runner.forward

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return forward(*args)

    runner.forward = counting
    requests, both, step = [], [], 0
    while len(requests) < len(prompts) or engine.has_unfinished():
        if step % 2 == 0 and len(requests) < len(prompts):
            requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
        before = calls[0]
        decision = engine.scheduler.schedule
        seen: list[Any] = []
        engine.scheduler.schedule = lambda: seen.append(decision()) or seen[-1]
        engine.step()
        engine.scheduler.schedule = decision
        assert not seen[0].prefill or len(seen[0].decode) + sum(n for _, n in seen[0].prefill) <= budget
        if seen[0].prefill and seen[0].decode:
            both.append(calls[0] - before)
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
    assert max(both_mixed) == 1  # every step with both made one target forward
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


def test_a_verification_step_beyond_the_token_budget_runs_whole(make_llm: Callable[..., Any], ckpt_a: Any) -> None:
    # the target drafting for itself (every draft accepted), K = 4, a budget of 8 tokens (the
    # three prompts in one step): each round verifies every running row's K + 1 tokens, 15 in
    # one pass, never a shorter K
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    plain = make_llm(ckpt_a, max_seq_len=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = make_llm(ckpt_a, max_seq_len=64, max_num_batched_tokens=8, use_speculative_decoding=True,
                   draft_model=str(ckpt_a), spec_length=4)
    runner, passes = llm.engine.runner, []
    forward = runner.forward
    runner.forward = lambda plan, *args: (passes.append(plan.query_lens), forward(plan, *args))[1]
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    verified = [lens for lens in passes if len(lens) == len(prompts) and set(lens) == {5}]
    assert verified and sum(verified[0]) > llm.engine.config.max_num_batched_tokens
    assert llm.engine.leak_report() == []


def test_rounds_leave_prefill_chunks_their_share_of_the_budget(make_llm: Callable[..., Any], ckpt_a: Any) -> None:
    # the target drafting for itself (every draft accepted), K = 4, a budget of 8: two running
    # rows verify 10 tokens a round, yet a prompt arriving meanwhile gets chunks of 8 - 2 (a
    # decode row counts one token) and decodes while the rounds go on, not after them
    llm = make_llm(ckpt_a, max_seq_len=96, max_batch_size=4, max_num_batched_tokens=8, use_speculative_decoding=True,
                   draft_model=str(ckpt_a), spec_length=4)
    engine = llm.engine
    running = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
               for p in ([5, 6, 7], [8, 9])]
    while not all(r.output_token_ids for r in running):
        engine.step()
    late = engine.add_request(list(range(20, 32)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    schedule, chunks = engine.scheduler.schedule, []

    def recording() -> Any:
        decision = schedule()
        chunks.extend(n for r, n in decision.prefill if r is late)
        assert len(decision.decode) + sum(n for _, n in decision.prefill) <= 8
        return decision

    engine.scheduler.schedule = recording
    while not late.output_token_ids:
        engine.step()
        assert not any(r.is_finished for r in running)
    assert chunks == [6, 6]
    engine.scheduler.schedule = schedule
    while engine.has_unfinished():
        engine.step()
    assert all(len(r.output_token_ids) == 40 for r in running) and engine.leak_report() == []
