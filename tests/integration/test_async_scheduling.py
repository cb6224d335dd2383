"""Overlapped scheduling (`async_scheduling=True`) against synchronous scheduling on the CPU.

On a CPU every "device" tensor is ready at once, but the overlapped path runs all the same:
a step's tokens stay in an `InFlight` until the next step is queued, the next step's input
ids are gathered from them, finishes decided by ids are learnt a step late (a wasted row),
and rendering (detokenization, stop strings) happens one step behind. Both modes must give
token-identical outputs: greedy, seeded sampling, speculation (draft model, n-gram,
adaptive), stop strings, stop ids mid-run (EOS's path), max_tokens, preemption, and give
every resource back.
"""

from __future__ import annotations

import pytest

from helpers.overlap import GREEDY, OVERLAP_CONFIGS, abort_in_flight, outputs, overlap_parity, overlap_prompts
from infer import SamplingParams


@pytest.fixture(scope="module")
def prompts(ckpt_a):
    return overlap_prompts(ckpt_a)


@pytest.mark.parametrize("config", list(OVERLAP_CONFIGS))
def test_overlapped_and_synchronous_scheduling_give_the_same_tokens(make_llm, ckpt_a, prompts, config):
    overlap_parity(make_llm, ckpt_a, prompts, config)


def test_a_finish_learnt_a_step_late_costs_a_wasted_row_not_a_token(make_llm, ckpt_a, prompts):
    # the stop id is seen when the next step is already queued: that step computes a row for
    # the finished request, whose token is dropped
    ref = outputs(make_llm(ckpt_a, max_seq_len=128), prompts[:1], [GREEDY])[0][0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[4]])
    rows = {}
    for overlap in (False, True):
        llm = make_llm(ckpt_a, max_seq_len=128, async_scheduling=overlap)
        seen, launch = [], llm.engine.runner._launch
        llm.engine.runner._launch = lambda prefill, decode, render: (seen.append(len(decode)), launch(prefill, decode,
                                                                                                     render))[1]
        out = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)[0].outputs[0]
        assert out.token_ids == ref[:5] and out.finish_reason == "stop"
        rows[overlap] = sum(seen)
    assert rows[True] == rows[False] + 1


def test_a_request_filling_the_context_gets_every_token_it_asked_for(make_llm, ckpt_a, prompts):
    # prompt + max_tokens == max_seq_len: the last token is accepted while none is in flight
    # any more; counting the in-flight one against the context cut the output a token short
    prompt = prompts[0][:20]
    params = SamplingParams(temperature=0, max_tokens=64 - len(prompt), ignore_eos=True)
    got = {}
    for overlap in (False, True):
        out = make_llm(ckpt_a, max_seq_len=64, async_scheduling=overlap).generate(
            prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
        assert len(out.token_ids) == params.max_tokens and out.finish_reason == "length"
        got[overlap] = out.token_ids
    assert got[True] == got[False]


def test_overlapped_steps_feed_the_tokens_in_flight_to_the_next_step(make_llm, ckpt_a, prompts):
    llm = make_llm(ckpt_a, max_seq_len=128, max_batch_size=4, async_scheduling=True)
    runner, gathered = llm.engine.runner, []
    launch = runner._launch

    def watching(prefill, decode, render):
        inflight = runner._inflight
        gathered.append(inflight is not None and any(inflight.holds(r) for r in decode))
        return launch(prefill, decode, render)

    runner._launch = watching
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(temperature=0, max_tokens=12))
    assert sum(gathered) >= 10  # most decode steps took their input ids from the step in flight


def test_an_abort_with_a_step_in_flight_gives_everything_back(make_llm, ckpt_a, prompts):
    abort_in_flight(make_llm, ckpt_a, prompts)


PREEMPTING = [[0, 25, 305, 128, 335, 11, 68, 349], [0, *range(100, 124)], [0, 382]]


def _step_through(make_llm, ckpt, overlap: bool, params: list[SamplingParams]) -> tuple[list[list[int]], object]:
    """Each request's tokens on a pool that holds two of PREEMPTING at a time, the engine
    driven step by step (a livelock fails the step cap)."""
    llm = make_llm(ckpt, async_scheduling=overlap, block_size=8, num_blocks=9, max_num_batched_tokens=16)
    engine = llm.engine
    requests = [engine.add_request(p, sp) for p, sp in zip(PREEMPTING, params, strict=True)]
    for _ in range(100):  # plain decoding needs fewer than 40 steps
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and not engine.leak_report()
    assert all(r.is_finished for r in requests)
    return [list(r.output_token_ids) for r in requests], engine


@pytest.mark.parametrize("stop", [False, True])
def test_a_request_preempted_with_its_last_token_in_flight_retires(make_llm, ckpt_a, stop):
    # the newest request is preempted while its last token is still in flight; that token,
    # accepted after the preemption, finishes it in the waiting queue. It used to stay there
    # (a leak), or be readmitted as running and never retire (a livelock), decoding on past
    # its stop string. Now it retires, with the tokens synchronous scheduling gives.
    params = [SamplingParams(max_tokens=10 - i, ignore_eos=True, seed=1 + i) for i in range(3)]
    if stop:  # the last request stops at the text its last token ends with
        tokens, engine = _step_through(make_llm, ckpt_a, False, params)
        text = engine.tokenizer.decode(tokens[2])[-2:]
        params[2] = SamplingParams(max_tokens=8, ignore_eos=True, seed=3, stop=[text])
    sync, _ = _step_through(make_llm, ckpt_a, False, params)
    overlapped, engine = _step_through(make_llm, ckpt_a, True, params)
    assert engine.scheduler.num_preemptions > 0
    assert overlapped == sync
