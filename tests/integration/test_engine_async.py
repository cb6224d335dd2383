"""AsyncEngine: streams, abort, and behaviour after the engine loop fails; engine-level
input validation."""

from __future__ import annotations

import asyncio

import pytest

from infer import SamplingParams
from infer.engine.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_stream_then_abort_frees_everything(make_llm, ckpt_a):
    llm = make_llm(ckpt_a, max_seq_len=128)
    ref = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].outputs[0].token_ids
    eng = AsyncEngine(llm.engine)  # from here on only the engine thread touches the engine

    async def main():
        stream = await eng.add_request([5, 6, 7], GREEDY, "a")
        outs = [o async for o in stream]
        long = await eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), "b")
        first = await long.__anext__()
        await long.aclose()  # consumer leaves early -> abort
        return outs, first

    outs, first = asyncio.run(main())
    assert [o.token_id for o in outs] == ref
    assert outs[-1].finished and first.token_id is not None
    for _ in range(1000):  # the abort is applied between steps; poll, bounded
        done = []
        eng.run_sync(lambda: done.append(not llm.engine.has_unfinished()))
        if done[0]:
            break
    assert llm.engine.leak_report() == []
    eng.shutdown()


def test_failed_loop_reports_and_rejects_new_requests(make_llm, ckpt_a, monkeypatch):
    llm = make_llm(ckpt_a, max_seq_len=128)
    eng = AsyncEngine(llm.engine)

    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(llm.engine.runner, "step", boom)

    async def main():
        stream = await eng.add_request([5, 6, 7], GREEDY, "a")
        return [o async for o in stream]

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason.value == "error" and "kernel exploded" in outs[-1].error
    assert not eng.healthy
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(eng.add_request([1, 2], GREEDY, "b"))
    eng.run_sync(lambda: None)  # the thread still answers commands
    assert llm.engine.leak_report() == []
    eng.shutdown()


def test_request_larger_than_the_kv_pool_is_rejected(make_llm, ckpt_a):
    llm = make_llm(ckpt_a, max_seq_len=256, kv_cache_backend="paged", block_size=4, num_blocks=10)
    with pytest.raises(ValueError, match="num_blocks"):
        llm.engine.add_request(list(range(5, 35)), SamplingParams(max_tokens=20))


@pytest.mark.parametrize("ids, words", [([], "empty"), ([10 ** 6], "outside the vocabulary"),
                                        (list(range(5, 200)), "max_seq_len")])
def test_bad_prompts_are_clear_errors(make_llm, ckpt_a, ids, words):
    llm = make_llm(ckpt_a, max_seq_len=128)
    with pytest.raises(ValueError, match=words):
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=16))


def test_engine_seed_makes_unseeded_sampling_reproducible(make_llm, ckpt_a):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10]]

    def run(seed):
        llm = make_llm(ckpt_a, max_seq_len=64, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]

    assert run(3) == run(3)
    assert run(3) != run(4)
