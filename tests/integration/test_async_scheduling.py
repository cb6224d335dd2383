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

import random

import pytest

from helpers.checkpoints import encode
from infer import SamplingParams

CONFIGS = {
    "plain": {},
    "draft": dict(use_speculative_decoding=True, spec_length=3),
    "ngram": dict(use_speculative_decoding=True, speculative_method="ngram", spec_length=3),
    # (c given: K must not follow the wall clock, for the seeded rows to be comparable)
    "adaptive": dict(use_speculative_decoding=True, spec_length=3, spec_policy="adaptive", spec_cost_coefficient=1.0),
    "tree": dict(use_speculative_decoding=True, spec_tree="2,1,1", spec_length=3),
    "ngram-tree": dict(use_speculative_decoding=True, speculative_method="ngram", spec_tree="2,1", spec_length=2),
    "preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=20, max_num_batched_tokens=8),
}


@pytest.fixture(scope="module")
def prompts(ckpt_a):
    rng = random.Random(11)
    words = "the cat sat on the mat and the dog sat on the log while a fox ran".split()
    return [encode(ckpt_a, " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))) for _ in range(6)]


def _params(reference: list[list[int]], tokenizer) -> list[SamplingParams]:
    """Greedy, seeded sampled, a stop id mid-run, a stop string, short max_tokens."""
    stop_id = reference[2][5]
    text = tokenizer.decode(reference[3], skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2] or "e"
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True, seed=5, top_p=0.9)]


def _outputs(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlapped_and_synchronous_scheduling_give_the_same_tokens(make_llm, ckpt_a, prompts, config):
    kw = dict(max_batch_size=4, max_seq_len=128, **CONFIGS[config])
    if kw.get("use_speculative_decoding") and kw.get("speculative_method", "draft_model") == "draft_model":
        kw["draft_model"] = str(ckpt_a)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = [o[0] for o in _outputs(make_llm(ckpt_a, max_seq_len=128), prompts, [greedy] * len(prompts))]
    sync = make_llm(ckpt_a, async_scheduling=False, **kw)
    params = _params(reference, sync.tokenizer)
    overlapped = make_llm(ckpt_a, async_scheduling=True, **kw)
    want = _outputs(sync, prompts, params)
    assert _outputs(overlapped, prompts, params) == want
    stop_id = _params(reference, sync.tokenizer)[2].stop_token_ids[0]
    assert want[2][2] == "stop" and want[2][0] == reference[2][:reference[2].index(stop_id) + 1]  # mid-run
    assert want[3][2] == "stop" and want[4][0] == reference[4][:5]
    assert overlapped.engine.runner.overlap and not sync.engine.runner.overlap
    if config == "preempt":
        assert overlapped.engine.scheduler.num_preemptions > 0


def test_a_finish_learnt_a_step_late_costs_a_wasted_row_not_a_token(make_llm, ckpt_a, prompts):
    # the stop id is seen when the next step is already queued: that step computes a row for
    # the finished request, whose token is dropped
    ref = _outputs(make_llm(ckpt_a, max_seq_len=128), prompts[:1],
                   [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)])[0][0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[4]])
    rows = {}
    for overlap in (False, True):
        llm = make_llm(ckpt_a, max_seq_len=128, async_scheduling=overlap)
        seen, decode = [], llm.engine.runner._decode
        llm.engine.runner._decode = lambda requests: (seen.append(len(requests)), decode(requests))[1]
        out = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)[0].outputs[0]
        assert out.token_ids == ref[:5] and out.finish_reason == "stop"
        rows[overlap] = sum(seen)
    assert rows[True] == rows[False] + 1


def test_overlapped_steps_feed_the_tokens_in_flight_to_the_next_step(make_llm, ckpt_a, prompts):
    llm = make_llm(ckpt_a, max_seq_len=128, max_batch_size=4, async_scheduling=True)
    runner, gathered = llm.engine.runner, []
    launch = runner._launch

    def watching(prefill, decode):
        inflight = runner._inflight
        gathered.append(inflight is not None and any(inflight.holds(r) for r in decode))
        return launch(prefill, decode)

    runner._launch = watching
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(temperature=0, max_tokens=12))
    assert sum(gathered) >= 10  # most decode steps took their input ids from the step in flight


def test_an_abort_with_a_step_in_flight_gives_everything_back(make_llm, ckpt_a, prompts):
    llm = make_llm(ckpt_a, max_seq_len=128, max_batch_size=4, async_scheduling=True,
                   use_speculative_decoding=True, speculative_method="ngram", spec_length=3)
    engine = llm.engine
    full = _outputs(make_llm(ckpt_a, max_seq_len=128), prompts[:2],
                    [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 2)
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in prompts[:2]]
    for _ in range(4):
        engine.step()
    final = engine.abort(reqs[0].request_id)
    assert final is not None and final.finished and final.finish_reason.value == "abort"
    assert full[0][0][:len(reqs[0].output_token_ids)] == reqs[0].output_token_ids  # what it had: a prefix
    while engine.has_unfinished():
        engine.step()
    assert reqs[1].output_token_ids == full[1][0]
    assert engine.leak_report() == [] and not engine.runner.has_pending()
