"""Speculative decoding end to end (CPU, tiny checkpoints).

Greedy parity with plain decoding for 8 prompts, batch 1 and 8, both backends, prefix
caching on, chunked prefill forced small, forced preemption; with (a) an unrelated random
draft (acceptance near 0), (b) the target as its own draft (acceptance ~1), and n-gram
drafting. Stop conditions inside accepted runs, max_tokens, the overflow guard near
max_seq_len, several StepOutputs per request per step.
"""

from __future__ import annotations

import pytest

from helpers.spec_e2e import DEPTH as K, ENGINE_CONFIGS, GREEDY, MAX_NEW, CyclePolicy, run as _run, spec_llm as _spec_llm
from infer import SamplingParams


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_self_draft(make_llm, ckpt_a, prompts, plain_outputs, config, batch):
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, batch, **ENGINE_CONFIGS[config])
    outs = _run(llm, prompts, batch)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    stats = llm.engine.runner.stats
    if config != "paged-preempt":  # recomputation after preemption restarts rounds
        assert stats.acceptance_rate >= 0.99
        assert stats.accepted_tokens / stats.drafts >= 0.99 * K  # mean accepted length
    for o in outs:
        assert o.outputs[0].acceptance_rate is not None


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_random_draft(make_llm, ckpt_a, random_draft, prompts, plain_outputs, config, batch):
    llm = _spec_llm(make_llm, ckpt_a, random_draft, batch, **ENGINE_CONFIGS[config])
    outs = _run(llm, prompts, batch)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert llm.engine.runner.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("method", ["ngram", "prompt_lookup"])
@pytest.mark.parametrize("config", ["contiguous", "paged-prefix-small-chunks"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_parity_ngram(make_llm, ckpt_a, prompts, plain_outputs, method, config, batch):
    llm = _spec_llm(make_llm, ckpt_a, None, batch, method=method, **ENGINE_CONFIGS[config])
    outs = _run(llm, prompts, batch)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert llm.engine.runner.stats.rounds > 0


def test_several_outputs_per_step(make_llm, ckpt_a, prompts):
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    engine = llm.engine
    req = engine.add_request(prompts[0], GREEDY)
    engine.step()  # prefill: first token
    results = engine.step()  # one speculation round
    mine = [out for r, out in results if r is req]
    assert len(mine) == K + 1
    assert [o.token_id for o in mine] == req.output_token_ids[1:K + 2]
    while engine.has_unfinished():
        engine.step()


def test_stop_token_inside_accepted_run(make_llm, ckpt_a, prompts, plain_outputs):
    ref = plain_outputs[0]
    stop_at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])  # first occurrence mid-run
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[ref[stop_at]])
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    out = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params)[0].outputs[0]
    assert out.token_ids == ref[:stop_at + 1]
    assert out.finish_reason == "stop"


def test_stop_string_inside_accepted_run(make_llm, ckpt_a, prompts, plain_outputs):
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    tok = llm.tokenizer
    full = tok.decode(plain_outputs[0], skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() and full[i:i + 2] not in full[:i + 1])
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop])
    engine = llm.engine
    req = engine.add_request(prompts[0], params)
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(o.text_delta for r, o in engine.step() if r is req)
    assert streamed == full[:full.index(stop)]
    assert req.output_text == streamed and req.finish_reason.value == "stop"


def test_max_tokens_inside_run(make_llm, ckpt_a, prompts, plain_outputs):
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=params)[0].outputs[0]
    assert out.token_ids == plain_outputs[1][:7]
    assert out.finish_reason == "length"


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_overflow_guard_near_max_seq_len(make_llm, ckpt_a, prompts, backend):
    prompt = prompts[2]
    max_seq_len = len(prompt) + 13  # not a multiple of K + 1: the last rounds must shrink
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    plain = make_llm(ckpt_a, max_seq_len=max_seq_len, kv_cache_backend=backend)
    ref = plain.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    llm = make_llm(ckpt_a, max_seq_len=max_seq_len, kv_cache_backend=backend, use_speculative_decoding=True,
                   draft_model=str(ckpt_a), spec_length=6)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    assert out.token_ids == ref and len(ref) == 13


def test_a_draft_padded_to_another_vocabulary_size_drafts_over_its_tokens(make_llm, tmp_path, ckpt_a, prompts,
                                                                          plain_outputs):
    # (other tokenizers: test_foreign_vocab_e2e.py)
    from transformers import LlamaForCausalLM

    from helpers.checkpoints import hf_config, write_tokenizer
    other = tmp_path / "other"
    _, bos, eos = write_tokenizer(other)
    LlamaForCausalLM(hf_config("a", 400, bos, eos)).save_pretrained(other)  # 16 padding logits more
    llm = _spec_llm(make_llm, ckpt_a, other, 8)
    assert [o.outputs[0].token_ids for o in _run(llm, prompts, 8)] == plain_outputs
    assert llm.engine.runner.stats.shared_vocabulary == 1.0 and llm.engine.runner.stats.draft_tokens > 0


@pytest.mark.parametrize("kwargs, words", [
    (dict(use_speculative_decoding=True, draft_model=None, model="x"), "requires draft_model"),
    (dict(use_speculative_decoding=True, draft_model="x", batching_mode="static"), "batching_mode"),
    (dict(spec_length=0), "spec_length"),
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(cuda_graph_sampling_batch_max=-1), "cuda_graph_sampling_batch_max"),
])
def test_config_validation(kwargs, words):
    from infer import EngineConfig
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_rows_with_smaller_k_stop_drafting(make_llm, ckpt_a, prompts, backend):
    # two requests reach max_seq_len at different times: the guard shrinks one row's k while
    # the other still drafts K; the short row must not write past its capacity
    long_p, short_p = prompts[0][:25] + [5] * max(0, 25 - len(prompts[0])), prompts[1][:9]
    ps = [long_p, short_p]
    params = [SamplingParams(temperature=0, max_tokens=64 - len(p), ignore_eos=True) for p in ps]
    plain = make_llm(ckpt_a, max_seq_len=64, kv_cache_backend=backend, max_batch_size=2)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=params)]
    llm = make_llm(ckpt_a, max_seq_len=64, kv_cache_backend=backend, max_batch_size=2,
                   use_speculative_decoding=True, draft_model=str(ckpt_a), spec_length=5)  # self-draft: full k
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=params)] == ref


class _SomeDraftPolicy(CyclePolicy):
    """K for the requests whose id is in `drafting`, plain decoding for the rest."""

    def __init__(self, drafting):
        super().__init__([K])
        self.drafting = drafting

    def choose(self, requests, overhead=0.0):
        ks = super().choose(requests)
        return [k if r.request_id in self.drafting else 0 for r, k in zip(requests, ks)]


def test_a_request_takes_a_draft_slot_at_its_first_round_only(make_llm, ckpt_a, prompts, plain_outputs):
    # a request that never drafts holds no draft slot (nor blocks) at any time; one that
    # drafts gets its slot at its first round and gives it back at its finish
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, kv_cache_backend="paged", block_size=4)
    runner = llm.engine.runner
    drafting = {"req-1", "req-4"}
    runner.speculation.policy = _SomeDraftPolicy(drafting)
    holders, step = set(), llm.engine.step

    def recording():
        out = step()
        holders.update(r.request_id for r in llm.engine.scheduler.running
                       if r.slot in runner.speculation.draft.draft_slots)
        return out

    llm.engine.step = recording
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert holders == drafting and runner.stats.drafts > 0
    assert runner.speculation.draft.draft_slots == {} and llm.engine.leak_report() == []


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_draft_catches_up_after_plain_steps(make_llm, ckpt_a, prompts, plain_outputs, backend):
    # gaps of 1, 2, 3 and 6 plain steps: short ones ride along with draft step 1 (a chunk of up
    # to max_feed tokens), the long one runs as its own catch-up prefill. A self-draft accepts
    # everything only if its cache holds exactly the request's tokens after every switch.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(ckpt_a, max_seq_len=256, kv_cache_backend=backend)
             .generate(prompt_token_ids=prompts[:2], sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 2, kv_cache_backend=backend, block_size=4)
    runner = llm.engine.runner
    runner.speculation.policy = CyclePolicy([3, 0, 2, 0, 0, 3, 0, 0, 0, 4] + [0] * 6 + [2])
    catch_ups = []
    original = runner.speculation.draft.catch_up
    runner.speculation.draft.catch_up = lambda reqs: (reqs and catch_ups.append(len(reqs)), original(reqs))[1]
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert runner.speculation.draft.max_feed == 4
    # the first round prefills the prompts, then only the 6-step gaps need a prefill
    assert catch_ups and len(catch_ups) <= 1 + 40 // 17 + 1
    assert runner.stats.acceptance_rate >= 0.99


def test_ngram_tables_are_built_under_the_prefill(make_llm, ckpt_a, prompts):
    # a prompt's n-gram table is built while the prefill's forward runs (not before a decode
    # step's forward): the decode steps only extend it, and it goes with the request
    llm = _spec_llm(make_llm, ckpt_a, None, 1, method="ngram", max_num_batched_tokens=8)
    engine, proposer = llm.engine, llm.engine.runner.speculation.proposer
    req = engine.add_request(prompts[0], GREEDY)
    while not req.output_token_ids:
        engine.step()  # prefill chunks, then the first token
    table = proposer.table(req.request_id)
    assert table is not None and table.history == prompts[0]
    assert any(line.startswith("n-gram tables kept for") for line in engine.leak_report())  # (in use)
    engine.step()
    assert proposer.table(req.request_id) is table and table.history == req.all_token_ids[:len(table.history)]
    while engine.has_unfinished():
        engine.step()
    assert proposer.table(req.request_id) is None and len(proposer) == 0 and engine.leak_report() == []


def test_steps_without_proposals_are_plain_steps(make_llm, ckpt_a, prompts, plain_outputs):
    # a proposer that finds nothing proposes nothing: the step must be the plain decode step
    # (no verification pass). The stand-in implements the Proposer protocol and nothing else.
    from infer.speculative.tree import Draft
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
    runner = llm.engine.runner

    class Nothing:
        def propose(self, requests, shape, depths):
            return [Draft.empty(shape) for _ in requests]

        def on_accepted(self, requests, paths):
            raise AssertionError("nothing was verified")

        def verifying(self, requests, drafts, starts, verdict):
            raise AssertionError("nothing was verified")

        def prefilled(self, requests):
            return None

        def observed(self, requests, starts, rows):
            return None

        def release(self, request):
            return None

        def can_admit(self, request):
            return True

        def ensure_capacity(self, request, total_tokens, take=False):
            return True

        def pools(self):
            return []

        def leak_report(self):
            return []

    runner.speculation.proposer = Nothing()
    verified = []
    original, queued = runner.verification.general, runner.verification.queue
    runner.verification.general = lambda *args: (verified.append(1), original(*args))[1]
    runner.verification.queue = lambda *args: (verified.append(1), queued(*args))[1]
    choose, plain_choices = runner.speculation.policy.choose, []

    def counting(*args):
        ks = choose(*args)
        plain_choices.append(not any(ks))  # (the overflow guard gives K = 0 for last tokens)
        return ks

    runner.speculation.policy.choose = counting
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert not verified and runner.stats.rounds == 0
    assert sum(plain_choices) < len(plain_choices)  # (the length guard gives K = 0 for last tokens)


@pytest.mark.parametrize("draft", ["self", "random"])
def test_greedy_parity_with_repetition_penalty(make_llm, ckpt_a, random_draft, prompts, draft):
    # the penalty reads the growing context at every verified position (and at every draft
    # step): a wrong context changes the argmax somewhere in 8 prompts x 21 tokens
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
    plain = make_llm(ckpt_a, max_seq_len=256, max_batch_size=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a if draft == "self" else random_draft, 8)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.runner.stats.rounds > 0


def test_long_catch_ups_run_in_chunks(make_llm, ckpt_a, prompts, monkeypatch):
    # catch-ups are fed in chunks of at most CATCH_UP_CHUNK tokens per row (the Triton path on
    # a GPU); with a tiny chunk the prompts' lazy prefill and every gap take several chunks
    import infer.speculative.draft_model as dm
    monkeypatch.setattr(dm, "CATCH_UP_CHUNK", 3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(ckpt_a, max_seq_len=256)
             .generate(prompt_token_ids=prompts[:2], sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 2)
    runner = llm.engine.runner
    runner.speculation.policy = CyclePolicy([3] + [0] * 9)
    widths, inside, counted = [], [], []
    draft_fns = [runner.speculation.draft.step_forward]  # its flat passes
    catch_up = runner.speculation.draft.catch_up

    def spy(fn):
        def forward(plan, *args, **kwargs):
            if inside:
                widths.append(max(plan.query_lens))
            return fn(plan, *args, **kwargs)
        return forward

    def counting_catch_up(reqs):
        inside.append(1)
        before = len(widths)
        draft = runner.speculation.draft
        behind = [r.num_computed_tokens + 1 - draft.max_feed - draft.pool.seq_len(draft.slot(r))
                  for r in reqs]
        try:
            catch_up(reqs)
        finally:
            inside.clear()
        counted.append((len(widths) - before, max((-(-b // 3) for b in behind), default=0), len(reqs)))

    for f in draft_fns:
        f.run = spy(f.run)
    runner.speculation.draft.catch_up = counting_catch_up
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert widths and max(widths) <= 3 and len(widths) > 10
    # one batched forward per chunk of the longest gap
    assert counted and all(forwards == longest for forwards, longest, _ in counted), counted
    assert any(n == 2 for *_, n in counted)  # two requests caught up at once
    assert runner.stats.acceptance_rate >= 0.99
    assert runner.stats.acceptance_rate >= 0.99  # the draft cache holds exactly the tokens
    assert llm.engine.leak_report() == []


def test_an_fp8_draft_keeps_greedy_parity_with_the_target(make_llm, ckpt_a):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 5, 9, 22, 7], [1, 30, 31, 32], [1, 8, 8, 8, 8, 8, 8]]
    plain = make_llm(ckpt_a, max_batch_size=3, max_seq_len=64)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = make_llm(ckpt_a, max_batch_size=3, max_seq_len=64, use_speculative_decoding=True,
                   draft_model=str(ckpt_a), spec_length=4, draft_quantization="fp8")
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = llm.engine.runner.stats
    assert 0.5 < stats.acceptance_rate  # an FP8 copy of the target still drafts well
