"""The adaptive length policy, the batch gate and `spec_disable_batch_size` end to end (CPU,
tiny checkpoints), through the public counters: a useless draft turned off with greedy
parity kept, a good one kept drafting, n-gram drafts speculating where the text repeats
(shadow rounds while plain), rounds timed on a simulated clock and dropped where they cost
more than they give (the adaptive policy, and the gate under a fixed K), no start-up
measurement on a CPU, and speculation off above the batch limit.
"""

from __future__ import annotations

import pytest

from helpers.spec_e2e import DEPTH as K, GREEDY, spec_llm as _spec_llm
from infer import SamplingParams
from infer.speculative.policy import ClockConfig


def test_adaptive_parity_with_a_random_draft_that_it_turns_off(make_llm, ckpt_a, random_draft, prompts,
                                                                plain_outputs):
    # a useless draft (acceptance near 0) stops drafting after its first rounds: probes only,
    # one token each, ever rarer; the tokens stay plain decoding's
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = make_llm(ckpt_a, max_seq_len=256, max_batch_size=2)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts[:2], sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, random_draft, 2, spec_policy="adaptive")
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.runner.stats
    assert stats.acceptance_rate < 0.3
    assert stats.drafts <= 2 * 12  # per request: a few rounds, then probes every 16, 32, 64.. steps
    assert stats.draft_tokens <= stats.drafts * 2  # (one K=4 round at most before it turns off)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs


def test_adaptive_keeps_a_model_drafting_for_itself_speculating(make_llm, ckpt_a, prompts, plain_outputs):
    # c forced below 1 (on a CPU, c is the weight-byte ratio: 1 for a model drafting for itself)
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, spec_policy="adaptive", spec_cost_coefficient=0.25)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    stats = llm.engine.runner.stats
    assert stats.acceptance_rate >= 0.99 and stats.draft_tokens / stats.drafts >= K - 1


def test_adaptive_n_gram_speculates_where_the_text_repeats(make_llm, ckpt_a, prompts, plain_outputs):
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert llm.engine.runner.speculation.policy.config.c == 0.0 and llm.engine.runner.stats.drafts > 0
    assert llm.engine.runner.speculation.shadow is not None  # free drafts are scored while plain
    assert llm.engine.leak_report() == []  # (no shadow chain outlives its request)


def _clocked_run(llm, prompts, round_s, params=GREEDY):
    """Run the prompts on a simulated clock: a step takes 1 s and a round's verification
    `round_s` more. Returns (engine, tokens, whether a plain step was queued with the
    previous step's tokens still in flight)."""
    runner, now = llm.engine.runner, [0.0]

    def tick():
        now[0] += 1.0
        return now[0]

    def queue(*args, _run=runner.verification.queue):  # (every round of these greedy rows is queued)
        now[0] += round_s
        return _run(*args)

    overlapped = []

    def launch(prefill, decode, render, _launch=runner._launch):
        if decode:
            overlapped.append(runner._inflight is not None)
        return _launch(prefill, decode, render)

    runner._time, runner.verification.queue, runner._launch = tick, queue, launch
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return llm, [o.outputs[0].token_ids for o in outs], any(overlapped)


def _clocked_ngram_run(make_llm, ckpt_a, prompts, round_s):
    """An adaptive n-gram engine (c = 0), overlapped, on the simulated clock."""
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive", async_scheduling=True)
    return _clocked_run(llm, prompts, round_s)


def test_adaptive_times_its_rounds_and_stops_where_they_cost_more_than_they_give(make_llm, ckpt_a, prompts,
                                                                                  plain_outputs):
    # rounds that cost 30 plain steps of host time the start-up model cannot see: once the
    # clock has timed a few, the requests decode plainly (overlapped); free rounds go on
    dear, dear_tokens, dear_overlapped = _clocked_ngram_run(make_llm, ckpt_a, prompts, 30.0)
    cheap, cheap_tokens, _ = _clocked_ngram_run(make_llm, ckpt_a, prompts, 0.0)
    assert dear_tokens == cheap_tokens == plain_outputs
    dear_clock, cheap_clock = dear.engine.runner.speculation.clock, cheap.engine.runner.speculation.clock
    assert dear_clock.overhead(8) > 10 and abs(cheap_clock.overhead(8)) < 0.5
    assert dear.engine.runner.speculation.clock.plain_step_s(8) == pytest.approx(1.0)
    assert dear.engine.runner.stats.drafts < cheap.engine.runner.stats.drafts / 2
    assert dear_overlapped  # plain steps keep the host ahead of the device
    assert dear.engine.leak_report() == [] and cheap.engine.leak_report() == []


def test_the_batch_gate_turns_a_fixed_k_off_where_rounds_give_fewer_tokens_a_second(make_llm, ckpt_a, prompts):
    # a model drafting for itself (every draft accepted: K + 1 tokens a round) under a fixed
    # K: rounds costing 31 plain steps give fewer tokens a second, so after its first timed
    # rounds the batch decodes plainly, probed now and then; rounds costing 2 go on
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain = make_llm(ckpt_a, max_seq_len=256, max_batch_size=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]

    def run(round_s):
        llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, spec_batch_gate=True, async_scheduling=True)
        return _clocked_run(llm, prompts, round_s, params)
    dear, dear_tokens, dear_overlapped = run(30.0)
    cheap, cheap_tokens, _ = run(1.0)
    assert dear_tokens == cheap_tokens == ref
    dear_clock, cheap_clock = dear.engine.runner.speculation.clock, cheap.engine.runner.speculation.clock
    assert dear_clock.gate and dear_clock.speedup(8) < 0.2 and cheap_clock.speedup(8) > 1.5
    # a request's 100 tokens: dear, 3 rounds timed, then plain until one probe; cheap, rounds
    # of K + 1 tokens nearly throughout (about 100 / (K + 1) = 20 each)
    assert dear.engine.runner.stats.drafts <= 8 * (3 + ClockConfig().probe_rounds)
    # every plain step the gate kept counts towards its wait (else it would never probe again)
    gate = dear_clock.report()[8]
    assert not gate["rounds_on"] and gate["plain_steps"] - 8 <= gate["waited"] < gate["wait"]
    assert cheap.engine.runner.stats.drafts >= 8 * 16
    assert dear_overlapped  # plain steps keep the host ahead of the device
    assert dear.engine.leak_report() == [] and cheap.engine.leak_report() == []


def test_the_batch_gate_is_off_on_a_cpu_unless_asked_for(make_llm, ckpt_a):
    # on a CPU nothing is timed by default: a fixed K's outputs never depend on the machine
    assert _spec_llm(make_llm, ckpt_a, ckpt_a, 2).engine.runner.speculation.clock is None
    asked = _spec_llm(make_llm, ckpt_a, ckpt_a, 2, spec_batch_gate=True).engine.runner.speculation.clock
    assert asked is not None and asked.gate and asked.model_cost is None


def test_an_adaptive_engine_on_a_cpu_measures_nothing_at_start(make_llm, ckpt_a, random_draft, monkeypatch):
    # c comes from the weight bytes there: the engine runs no forward before its first request
    import infer.engine.step_costs as step_costs
    monkeypatch.setattr(step_costs, "forward_times", lambda *a, **k: pytest.fail("measured on a CPU"))
    llm = _spec_llm(make_llm, ckpt_a, random_draft, 2, spec_policy="adaptive")
    from infer.engine.step_costs import weight_bytes
    models = llm.engine.models
    c = llm.engine.runner.speculation.policy.config.c
    assert c == pytest.approx(weight_bytes(models.draft) / weight_bytes(models.target))


@pytest.mark.parametrize("limit, speculates", [(4, False), (8, True)])
def test_spec_disable_batch_size_turns_speculation_off_above_it(make_llm, ckpt_a, prompts, plain_outputs, limit,
                                                                 speculates):
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, spec_disable_batch_size=limit)
    seen, launch = [], llm.engine.runner._launch
    llm.engine.runner._launch = lambda prefill, decode, render: (seen.append(len(decode)), launch(prefill, decode,
                                                                                                 render))[1]
    drafts = []
    propose = llm.engine.runner.speculation.proposer.propose
    llm.engine.runner.speculation.proposer.propose = \
        lambda requests, shape, ks: (drafts.append(len(requests)), propose(requests, shape, ks))[1]
    reserved, decode_widths = [], llm.engine.scheduler.kv.decode_widths  # (batch, widest round reserved)
    llm.engine.scheduler.kv.decode_widths = lambda batch: lambda request: (
        widths := decode_widths(batch)(request), reserved.append((batch, widths[0])))[0]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert max(seen) == 8 and (max(drafts, default=0) == 8) == speculates
    assert all(n <= limit for n in drafts)
    # past the limit a step reserves a plain step's room alone, in neither pool a round's
    assert all(width == 1 for batch, width in reserved if batch > limit)
    assert any(width > 1 for batch, width in reserved if batch == 8) == speculates


def test_a_preempted_request_keeps_what_the_policy_learnt_of_it(make_llm, ckpt_a, prompts):
    # preemption frees a request's memory; what the adaptive policy learnt of its acceptance
    # stays until it leaves the engine, so its rounds after readmission are the ones it would
    # have run (a fresh estimate changed its K, and a seeded request's samples with it)
    llm = make_llm(ckpt_a, max_seq_len=256, block_size=2, num_blocks=40, use_speculative_decoding=True,
                   draft_model=str(ckpt_a), spec_length=3, spec_policy="adaptive", spec_cost_coefficient=0.2)
    policy = llm.engine.runner.speculation.policy
    released, release = [], policy.release
    policy.release = lambda request_id: (released.append(llm.engine._requests[request_id].is_finished),
                                         release(request_id))[1]
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=5)
    first = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts[:4], sampling_params=params)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.stats.rounds > 0
    assert released and all(released)  # only requests that finished were forgotten
    assert llm.engine.leak_report() == []
    again = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts[:4], sampling_params=params)]
    assert again == first
