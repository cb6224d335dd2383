"""Speculative decoding end to end (CPU, tiny checkpoints).

Greedy parity with plain decoding for 8 prompts, batch 1 and 8, both backends, prefix
caching on, chunked prefill forced small, forced preemption; with (a) an unrelated random
draft (acceptance near 0), (b) the target as its own draft (acceptance ~1), and n-gram
drafting. Stop conditions inside accepted runs, max_tokens, the overflow guard near
max_seq_len, several StepOutputs per request per step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from helpers.checkpoints import encode, make_checkpoint
from infer import SamplingParams
from infer.engine.speculative_runner import EPISODE_CHECK_STEPS, KEEP_UP_EVERY

K = 4
MAX_NEW = 1 + 4 * (K + 1)  # prefill token + 4 full rounds: every round can draft K
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, ckpt_a):
    # same tokenizer and vocabulary, unrelated weights, fewer layers
    return make_checkpoint(tmp_path_factory.mktemp("draft"), variant="a", seed=123, num_hidden_layers=1)


@pytest.fixture(scope="module")
def prompts(ckpt_a):
    rng = random.Random(3)
    words = "the cat sat on the mat and the dog sat on the log while a fox ran".split()
    return [encode(ckpt_a, " ".join(rng.choice(words) for _ in range(rng.randint(2, 25)))) for _ in range(8)]


@pytest.fixture(scope="module")
def plain_outputs(ckpt_a, prompts):
    from infer import LLM
    llm = LLM(str(ckpt_a), device="cpu", kv_cache_backend="contiguous", max_seq_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


ENGINE_CONFIGS = {
    "contiguous": dict(kv_cache_backend="contiguous"),
    "paged-prefix-small-chunks": dict(kv_cache_backend="paged", block_size=4, max_num_batched_tokens=6),
    "paged-preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=48, max_num_batched_tokens=16),
}


def _spec_llm(make_llm, target, draft, batch, method="draft_model", **extra):
    kw = dict(max_batch_size=batch, max_seq_len=256, use_speculative_decoding=True, spec_length=K,
              speculative_method=method, **extra)
    if method == "draft_model":
        kw["draft_model"] = str(draft)
    return make_llm(target, **kw)


def _run(llm, prompts, batch):
    if batch == 1:
        return [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    return llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)


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


def test_adaptive_policy_parity(make_llm, ckpt_a, random_draft, prompts, plain_outputs):
    llm = _spec_llm(make_llm, ckpt_a, random_draft, 8, spec_policy="adaptive")
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs


def test_adaptive_runner_measures_drafting_apart(make_llm, ckpt_a, random_draft, prompts):
    # the cost model learns what a draft step really costs from the rounds' drafting time
    # (catch-up excluded), so unseen K are priced from real draft steps
    llm = _spec_llm(make_llm, ckpt_a, random_draft, 4, spec_policy="adaptive")
    # (these requests are short: their early probes, which measure the rounds here, would
    # cost more than `early_probe_share` of what they have left)
    llm.engine.runner.policy.early_probe_share = 1.0
    costs = llm.engine.runner.cost_model
    calls, observe_draft = [], costs.observe_draft
    costs.observe_draft = lambda b, k, seconds, sampled: (calls.append((b, k, seconds, sampled)),
                                                          observe_draft(b, k, seconds, sampled))[1]
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=GREEDY)
    rounds = llm.engine.runner.stats.drafts  # per request: a batched step holds several
    assert 0 < len(calls) <= rounds  # one per step with drafts
    assert all(1 <= b <= 4 and 1 <= k <= 8 and seconds > 0 and not sampled for b, k, seconds, sampled in calls)


def test_costs_are_filed_under_the_batchs_sampling_mode(make_llm, ckpt_a, prompts):
    # a sampled batch's steps cost more (sampling, rejection sampling): its measurements go
    # to the sampled costs, a greedy batch's to the greedy ones, and a batch with any
    # sampled request is a sampled batch
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 4, spec_policy="adaptive")
    costs = llm.engine.runner.cost_model
    filed, observe = [], costs.observe
    costs.observe = lambda b, k, seconds, sampled: (filed.append((b, k, sampled)), observe(b, k, seconds, sampled))[1]
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for params in ([greedy], [sampled], [greedy, sampled]):
        filed.clear()
        llm.generate(prompt_token_ids=prompts[:len(params)], sampling_params=params)
        modes = {mode for b, _, mode in filed if b == len(params)}
        assert modes == {params[-1].temperature > 0}, (params, filed)
    assert {mode for (_, _, mode) in costs.observed} == {False, True}


@pytest.mark.parametrize("config", ["contiguous", "paged-preempt"])
def test_adaptive_ngram_shadow_drafts_change_no_token(make_llm, ckpt_a, prompts, config):
    # shadow drafts only steer the policy: the output is plain decoding's, every shadow is
    # checked against real tokens, and nothing is held once the requests are gone (the
    # fixture's leak check covers the shadow state too)
    from infer import LLM
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(ckpt_a), device="cpu", kv_cache_backend="contiguous", max_seq_len=256)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive", **ENGINE_CONFIGS[config])
    runner = llm.engine.runner
    runner.shadow.interval = 2
    # (where this CPU's costs leave nothing that could pay for the batch, the gate would turn
    # shadows off; this test is about what they do when on)
    runner.policy.worth_shadowing = lambda batch, sampled: True
    counted, count = [], runner.policy.count_shadowed
    runner.policy.count_shadowed = lambda batch, sampled, n: (counted.append(n), count(batch, sampled, n))[1]
    runner.policy = runner.policy  # (the runner binds the policy's hooks when it is set)
    seen, observe = [], runner.shadow.observe

    def recording(rid, k, matched):
        request = next(r for r in requests if r.request_id == rid)
        seen.append(matched)
        observe(rid, k, matched)
        assert 0 <= matched <= k and request.num_tokens > 0

    runner.shadow.observe = recording
    takes, take = [], runner.shadow.take
    runner.shadow.take = lambda *a: (takes.append(1), take(*a))[1]
    steps, step = [], runner.step
    runner.step = lambda prefill, decode: (steps.append(bool(decode)), step(prefill, decode))[1]
    requests = [llm.engine.add_request(p, params) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
    # one look per decode step, proposals found or not, plain stretches' steps included; the
    # policy counted each (`count_shadowed`: the shadows' patience)
    assert len(takes) == sum(steps) and takes
    assert sum(counted) == len(takes)
    assert [r.output_token_ids for r in requests] == expected
    assert seen, "no shadow draft was checked"
    assert len(runner.shadow) == 0


def test_shadow_drafts_go_on_in_plain_stretches(make_llm, ckpt_a, prompts, plain_outputs):
    # a request kept plain (speculating never pays by the margin) decodes in plain stretches
    # whose steps still take and check shadow drafts under the forward; evidence that ends
    # the all-plain decision (forced here at every third draft) ends the stretch there
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    runner.shadow.interval = 2
    runner.policy.switch_margin = runner.policy.stay_margin = 1e9
    runner.policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    runner.policy.worth_shadowing = lambda batch, sampled: True  # (the margins alone would turn shadows off)
    # early probes (these short requests' would cost more than `early_probe_share` of what
    # they have left) end stretches before the requests do: some stretches run to their end
    runner.policy.early_probe_share = 1.0
    runner.policy = runner.policy  # (the runner binds the policy's hooks when it is set)
    forced, observe = [], runner.shadow.observe

    def observing(*args):
        observe(*args)
        if len(forced) % 3 == 2:  # as evidence that makes the request speculate would
            runner.policy.end_quiet()
        forced.append(len(forced) % 3 == 2 and runner._stretch.active)

    runner.shadow.observe = observing
    verdicts, each_step = [], runner._stretch.each_step
    runner._stretch.each_step = lambda rs: (verdicts.append((each_step(rs), len(runner.shadow))), verdicts[-1][0])[1]
    # the proposer's tables follow the stretch: brought up to date every KEEP_UP_EVERY steps,
    # at the stretch's last step and at one that ends it (a round may follow)
    behind, calls, keep_up = [], [], runner._keep_up

    def keeping_up(requests, busy=None):
        keep_up(requests, busy)
        stretch = runner._stretch
        if not stretch.done:  # a prefill's
            return
        calls.append((len(verdicts), stretch.done, stretch.left))  # (the step's verdict is appended next)
        behind.extend(r.num_tokens - runner.proposer._entries[r.request_id].synced for r in requests
                      if r.request_id in runner.proposer._entries)

    runner._keep_up = keeping_up
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts[:4]]
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[:4]
    assert runner.stats.drafts == 0
    ended = [v for v, _ in verdicts]
    assert ended.count(False) > 20
    assert ended.count(True) == sum(forced) >= 2  # each forced end inside a stretch ended it
    assert any(pending for _, pending in verdicts)  # drafts were taken inside stretches
    assert set(behind) == {0}
    assert len(verdicts) // KEEP_UP_EVERY <= len(calls) < len(verdicts)  # not at every step
    ends = {i for i, (v, _) in enumerate(verdicts) if v}
    assert ends <= {i for i, _, _ in calls}
    assert all(done % KEEP_UP_EVERY == 0 or not left or i in ends for i, done, left in calls)
    assert any(not left for _, _, left in calls)  # stretches ran to their last step too
    assert llm.engine.leak_report() == []


def test_a_miss_is_watched_under_plain_forwards_instead_of_asked_again(make_llm, ckpt_a, prompts):
    # a sampled request that wants drafts but whose n-gram lookup finds nothing is looked up
    # under the following plain steps' forwards; the policy is asked again only once such a
    # lookup's draft came true (`proposal_ready`), a new request came or the longest
    # backoff ran out, never on the 2, 4, 8 ... schedule of steps (which greedy requests keep)
    llm = _spec_llm(make_llm, ckpt_a, None, 1, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    policy = runner.policy
    runner.cost_model.relative_costs = lambda batch, sampled: [1.0] * (K + 1)  # rounds priced free: speculate
    policy.calibration = None  # (and kept free: episodes on the CPU would price them up)
    policy.ledger = None  # (nor would the loss ledger lock them out)
    events: list[tuple[str, int]] = []
    steps = [0]  # decode steps so far (the policy's clock lags inside plain stretches)
    choose, no_proposal, found, step = policy.choose, policy.no_proposal, runner.shadow.found, runner.step

    def stepping(prefill, decode):
        steps[0] += bool(decode)
        return step(prefill, decode)

    runner.step = stepping
    # "ask": a choice that gives the request k > 0 (the proposer is then asked for a draft)
    policy.choose = lambda *args: (ks := choose(*args), events.append(("ask" if any(ks) else "choose", steps[0])))[0]
    policy.no_proposal = lambda rid: (events.append(("miss", steps[0])), no_proposal(rid))[1]
    runner.shadow.found = lambda rid: (events.append(("found", steps[0])), found(rid))[1]
    outs = []
    for i, p in enumerate(prompts * 2):
        events.append(("new", steps[0]))
        params = SamplingParams(temperature=0.5, max_tokens=64, ignore_eos=True, seed=i)
        outs.append(llm.generate(prompt_token_ids=[p], sampling_params=params)[0])
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    kinds = [kind for kind, _ in events]
    assert kinds.count("miss") >= 3 and kinds.count("found") >= 3 and runner.stats.drafts > 0
    # found at the step before, a real lookup has the rest of the draft: asked, it rarely misses
    found_asks = [events[kinds.index("ask", i + 1)] for i, kind in enumerate(kinds)
                  if kind == "found" and "ask" in kinds[i + 1:]]
    missed = [e for i, e in enumerate(events) if e[0] == "miss" and events[i - 1] in found_asks]
    assert len(missed) <= len(found_asks) // 2
    for i, (kind, at) in enumerate(events):
        if kind != "miss" or "ask" not in kinds[i + 1:]:
            continue
        nxt = kinds.index("ask", i + 1)
        assert ({"found", "new"} & set(kinds[i + 1:nxt]) or events[nxt][1] - at >= policy.max_probe_interval), \
            events[i:nxt + 1]
    # and a request found is asked at the very next step (in a plain stretch too: the first
    # token is checked right after the step), when the proposer has the rest of the draft
    for i, (kind, at) in enumerate(events):
        if kind == "found" and "ask" in kinds[i + 1:]:
            nxt = kinds.index("ask", i + 1)
            assert "new" in kinds[i + 1:nxt] or events[nxt][1] == at + 1, events[i:nxt + 1]
    assert llm.engine.leak_report() == []


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


def test_tokenizer_mismatch_is_a_clear_error(make_llm, tmp_path, ckpt_a):
    from transformers import LlamaForCausalLM

    from helpers.checkpoints import hf_config, write_tokenizer
    other = tmp_path / "other"
    _, bos, eos = write_tokenizer(other)
    LlamaForCausalLM(hf_config("a", 400, bos, eos)).save_pretrained(other)  # a different vocabulary
    with pytest.raises(ValueError, match="vocab"):
        make_llm(ckpt_a, use_speculative_decoding=True, draft_model=str(other))


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


class _SchedulePolicy:
    """Draft lengths from a fixed cycle (plain steps in between), like an adaptive policy that
    keeps switching: the draft must catch up on the tokens it skipped."""

    def __init__(self, cycle):
        self.cycle, self.i = cycle, 0

    def choose(self, requests, seq_lens, max_seq_len, tokens_left):
        from infer.spec.policy import guard_k
        k = self.cycle[self.i % len(self.cycle)]
        self.i += 1
        return [guard_k(k, n, max_seq_len, left) for n, left in zip(seq_lens, tokens_left)]

    def update(self, request_id, num_draft, num_accepted):
        return None

    def no_proposal(self, request_id):
        return None

    def release(self, request_id):
        return None


class _QuietSchedulePolicy(_SchedulePolicy):
    """The cycle, with the adaptive policy's standing all-plain decision: after a choice of
    0 for a batch, `quiet` holds for that same batch while the cycle says 0."""

    def __init__(self, cycle):
        super().__init__(cycle)
        self.standing, self.ended, self.chosen_over_held = None, 0, 0

    def choose(self, requests, seq_lens, max_seq_len, tokens_left):
        # a request that reserved one position (`holds_quiet`) must not be given a draft
        self.chosen_over_held += any(self.holds_quiet(r) for r in requests)
        ks = super().choose(requests, seq_lens, max_seq_len, tokens_left)
        self.standing = None if any(ks) else list(requests)
        return ks

    def quiet(self, requests):
        if self.standing is not None and list(requests) == self.standing and not self.cycle[self.i % len(self.cycle)]:
            self.i += 1
            return True
        return False

    def holds_quiet(self, request):
        return (self.standing is not None and not self.cycle[self.i % len(self.cycle)]
                and any(r is request for r in self.standing))

    def end_quiet(self):
        self.standing, self.ended = None, self.ended + 1


def test_quiet_steps_reserve_what_plain_decoding_does(make_llm, ckpt_a, prompts, plain_outputs):
    # under a standing all-plain decision a step needs one position in the target's cache
    # and none in the draft's, as plain decoding; the draft's cache grows when the request
    # speculates again, and catching up then must leave it exact (a self-draft accepts all)
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1, kv_cache_backend="paged", block_size=4)
    runner = llm.engine.runner
    runner.policy = policy = _QuietSchedulePolicy([3] + [0] * 9)
    seen, decode = [], runner._decode

    def recording(requests):
        (r,) = requests
        quiet = policy.holds_quiet(r)
        draft_slot = runner.draft._draft_slots.get(r.slot)  # (none before the request's first round)
        seen.append((quiet, r.num_computed_tokens, len(runner.cache_pool.block_table(r.slot)),
                     0 if draft_slot is None else len(runner.draft.pool.block_table(draft_slot))))
        return decode(requests)

    runner._decode = recording
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts[:4]]
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[:4]
    spans = [(a, b) for a, b in zip(seen, seen[1:]) if a[0] and b[0] and b[1] == a[1] + 1]
    assert len(spans) >= 20
    # the target's table grows only to hold position n (blocks of 4), the draft's not at all
    assert all(b[2] == max(a[2], -(-(b[1] + 1) // 4)) for a, b in spans)
    assert any(b[2] > a[2] for a, b in spans)
    assert all(a[3] == b[3] for a, b in spans)
    assert not all(q for q, *_ in seen)  # rounds ran in between
    assert runner.stats.acceptance_rate >= 0.99
    assert llm.engine.leak_report() == []


class _SomeDraftPolicy(_SchedulePolicy):
    """K for the requests whose id is in `drafting`, plain decoding for the rest."""

    def __init__(self, drafting):
        super().__init__([K])
        self.drafting = drafting

    def choose(self, requests, seq_lens, max_seq_len, tokens_left):
        ks = super().choose(requests, seq_lens, max_seq_len, tokens_left)
        return [k if r.request_id in self.drafting else 0 for r, k in zip(requests, ks)]


def test_a_request_takes_a_draft_slot_at_its_first_round_only(make_llm, ckpt_a, prompts, plain_outputs):
    # a request that never drafts holds no draft slot (nor blocks) at any time; one that
    # drafts gets its slot at its first round and gives it back at its finish
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, kv_cache_backend="paged", block_size=4)
    runner = llm.engine.runner
    drafting = {"req-1", "req-4"}
    runner.policy = _SomeDraftPolicy(drafting)
    holders, step = set(), llm.engine.step

    def recording():
        out = step()
        holders.update(r.request_id for r in llm.engine.scheduler.running if r.slot in runner.draft._draft_slots)
        return out

    llm.engine.step = recording
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert holders == drafting and runner.stats.drafts > 0
    assert runner.draft._draft_slots == {} and llm.engine.leak_report() == []


def test_a_batch_change_under_a_quiet_decision_decodes_plainly(make_llm, ckpt_a, prompts, plain_outputs):
    # requests that reserved one position under the all-plain decision must not draft when
    # the batch changes (a request joins after its chunked prefill, another leaves): that
    # step is plain and the decision ends
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, kv_cache_backend="paged", block_size=4,
                    max_num_batched_tokens=6)
    runner = llm.engine.runner
    runner.policy = policy = _QuietSchedulePolicy([2] + [0] * 5)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert policy.ended >= 1 and policy.chosen_over_held == 0
    assert llm.engine.leak_report() == []


class _StretchPolicy(_QuietSchedulePolicy):
    """With `quiet_steps_left`: the runner may run the zeros ahead as a plain stretch."""

    def quiet_steps_left(self):
        n = 0
        while n < len(self.cycle) and not self.cycle[(self.i + n) % len(self.cycle)]:
            n += 1
        return 0 if self.standing is None else n

    def count_quiet_steps(self, steps):
        self.i += steps


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_plain_stretches_keep_the_policy_clock_and_the_tokens(make_llm, ckpt_a, prompts, plain_outputs, backend):
    # steps a standing all-plain decision covers run through the plain runner's methods:
    # neither `quiet` nor `choose` is asked, yet the policy counts every decode step, the
    # tokens are plain decoding's, and the draft catches up exactly when a round comes
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 2, kv_cache_backend=backend, block_size=4)
    runner = llm.engine.runner
    runner.policy = policy = _StretchPolicy([3] + [0] * 12)
    asked, steps, step = [], [], runner.step
    quiet, choose = policy.quiet, policy.choose
    policy.quiet = lambda requests: (asked.append("quiet"), quiet(requests))[1]
    policy.choose = lambda *a: (asked.append("choose"), choose(*a))[1]
    runner.step = lambda prefill, decode: (steps.append(bool(decode)), step(prefill, decode))[1]
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in prompts[:3]]
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[:3]
    decode_steps = sum(steps)
    # every decode step counted once: a request finishing during a stretch ends the decision
    # then (`end_quiet`), before the next step is reserved, so no step is decoded plainly
    # uncounted to end it
    assert policy.i == decode_steps and 1 <= policy.ended <= 3
    assert len(asked) < decode_steps / 2  # most steps ran in stretches, unasked
    assert runner.stats.drafts > 0 and runner.stats.acceptance_rate >= 0.99
    assert not runner._stretch.active and "_decode" not in vars(runner)
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("config", ["paged-prefix-small-chunks", "paged-preempt"])
def test_a_batch_change_ends_a_plain_stretch(make_llm, ckpt_a, prompts, plain_outputs, config):
    # requests leave at different times (max_tokens), join after chunked prefills, are
    # preempted while the scheduler reserves a stretch's step: each change ends the stretch,
    # and the outputs stay plain decoding's
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, **ENGINE_CONFIGS[config])
    runner = llm.engine.runner
    runner.policy = policy = _StretchPolicy([2] + [0] * 30)
    ends = []
    leave = runner._stretch.leave
    runner._stretch.leave = lambda: (ends.append(runner._stretch.active), leave())[1]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW - 2 * i, ignore_eos=True) for i in range(8)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [p[:MAX_NEW - 2 * i] for i, p in enumerate(plain_outputs)]
    assert any(ends)  # some stretch was cut short by a request leaving or joining
    assert policy.chosen_over_held == 0
    assert not runner._stretch.active and llm.engine.leak_report() == []


@pytest.mark.parametrize("keep", [True, False])
def test_a_request_finishing_under_a_plain_decision_keeps_the_stretch_going(make_llm, ckpt_a, prompts, keep):
    # nobody speculates (the switch margin is out of reach): a request finishing leaves the
    # all-plain decision standing for the rest of its cost bucket (`keep_quiet_without`), so
    # the stretch goes on without a full `choose`; only a bucket change (8 -> 4 -> 2 -> 1)
    # asks again. keep=False, the runner without the hook (as before), is the control:
    # every finish cuts the stretch short and asks
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive",
                    kv_cache_backend="paged", block_size=4)
    runner = llm.engine.runner
    policy = runner.policy
    policy.switch_margin = policy.stay_margin = 1e9
    policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    if not keep:
        runner._keep_quiet_without = None
    chosen, cut, choose, leave = [], [], policy.choose, runner._stretch.leave
    policy.choose = lambda requests, *a: (chosen.append(len(requests)), choose(requests, *a))[1]
    running = llm.engine.scheduler.running  # (at a finish, the rest of the batch)
    runner._stretch.leave = lambda: (cut.append((runner._stretch.left, len(running))), leave())[1]
    lengths = [48 - 4 * i for i in range(8)]  # one finish every 4 steps at the end
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1])  # a plain cost at batch 1
    chosen.clear(), cut.clear()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    plain = make_llm(ckpt_a, max_batch_size=8, max_seq_len=256, kv_cache_backend="paged", block_size=4)
    assert ([o.outputs[0].token_ids for o in outs]
            == [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)])
    cut_short = [n for left, n in cut if left]  # batch sizes at which a stretch was cut short
    asked_in_bucket_8 = sum(1 for n in chosen if 4 < n < 8)  # after a finish, with a plain cost there
    if keep:
        # cut short only where a finish changed the bucket (5 -> 4, 3 -> 2, 2 -> 1) or ended
        # the batch (sizes after the finish); a new bucket is asked until its plain step is measured
        assert set(cut_short) <= {4, 2, 1, 0} and asked_in_bucket_8 == 0
    else:
        assert {6, 5} <= set(cut_short) and asked_in_bucket_8 >= 3
    assert runner.stats.drafts == 0 and llm.engine.leak_report() == []
    assert runner._held == 0
    # finishes come after a step, not while the scheduler reserves one: the next batch's first
    # step is not held plain for a stretch the last finish ended
    assert any(left for left, n in cut if n == 0) and not runner._plain_reserved


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_finishes_in_a_stretch_wait_for_its_end_and_the_policy_never_sees_them_pending(make_llm, ckpt_a, prompts,
                                                                                      method):
    # a finish that leaves a stretch's batch in its cost bucket and sampling mode frees its
    # slots at once and leaves the speculative bookkeeping to the stretch's end
    # (`StretchFinishes`): the policy is never asked anything while some are pending, and in
    # the end every request's state is gone
    from infer.engine.stretch_finishes import StretchFinishes
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, method=method, spec_policy="adaptive",
                    kv_cache_backend="paged", block_size=4)
    runner = llm.engine.runner
    policy = runner.policy
    policy.switch_margin = policy.stay_margin = 1e9  # plain steps only
    policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    policy._probe_due = lambda *a: 10**9  # and no probes
    policy.recompute_every = 12  # decisions (and stretches) of a few steps: most end by their count
    taken, asked_pending = [], []
    take = StretchFinishes.take
    StretchFinishes.take = lambda self, request: (taken.append(r := take(self, request)), r)[1]

    def pending() -> bool:
        finishes = runner._stretch_finishes
        return finishes is not None and bool(finishes.deferred)

    for name in ("choose", "quiet", "holds_quiet", "keep_quiet_without"):
        inner = getattr(policy, name)
        setattr(policy, name, lambda *a, _inner=inner: (asked_pending.append(pending()), _inner(*a))[1])
    runner.policy = policy  # (the runner binds the policy's hooks when it is set)
    try:
        lengths = [60 - 2 * i for i in range(8)]  # a finish every 2 steps at the end (8 -> 5: bucket 8)
        params = [SamplingParams(temperature=[0.0, 1.0][i % 2], max_tokens=n, ignore_eos=True, seed=i)
                  for i, n in enumerate(lengths)]
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=params[:1])  # a plain cost at batch 1
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        StretchFinishes.take = take
    plain = make_llm(ckpt_a, max_batch_size=8, max_seq_len=256, kv_cache_backend="paged", block_size=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert [o.outputs[0].token_ids for o in outs] == expected and runner.stats.drafts == 0
    assert True in taken and not any(asked_pending)
    assert runner._stretch_finishes is None and policy._est == {}
    assert runner._held == 0 and llm.engine.leak_report() == []


def _timed_plain_steps(plain_steps: int, resample: int) -> list[int]:
    """The plain steps (1-based counts) timed outside stretches for one batch size and mode:
    the first two, then one whenever `resample` plain steps went by without a sample."""
    timed: list[int] = []
    for n in range(1, plain_steps + 1):
        if n <= 2 or n - (timed[-1] if timed else 0) >= resample:
            timed.append(n)
    return timed


def test_a_plain_step_next_to_rounds_is_timed_only_when_the_baseline_is_stale(make_llm, ckpt_a, prompts):
    # the step after a round runs cold: it is no sample of what staying plain costs, so it is
    # timed only for the first two plain steps or once PLAIN_RESAMPLE_EVERY plain steps went
    # by without a sample (while a policy speculates steadily the baseline still renews)
    from infer.engine.speculative_runner import PLAIN_RESAMPLE_EVERY
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([2] + [0] * 8 + [2] + [0] * 5)
    filed, observe = [], runner.cost_model.observe
    runner.cost_model.observe = lambda b, k, seconds, sampled: (filed.append((k, runner._plain_steps)),
                                                               observe(b, k, seconds, sampled))[1]
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=230,
                                                                              ignore_eos=True))
    assert sum(1 for k, _ in filed if k) >= 20  # rounds
    timed = [n for k, n in filed if k == 0]
    assert runner._plain_steps > 2 * PLAIN_RESAMPLE_EVERY
    assert timed == _timed_plain_steps(runner._plain_steps, PLAIN_RESAMPLE_EVERY)
    assert runner.cost_model.has_plain(1)


def test_a_timed_plain_step_leaves_the_policys_choice_out(make_llm, ckpt_a, prompts, monkeypatch):
    # the plain baseline is what staying plain costs: a step of a plain stretch, which asks
    # no `choose`; a plain step the policy chose is timed from after its choice (a fake
    # clock: the choice takes 1000 "seconds", everything else 1 a reading)
    from infer.engine import speculative_runner
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(speculative_runner, "time", SimpleNamespace(perf_counter=perf_counter))
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    runner = llm.engine.runner
    runner.policy = policy = _SchedulePolicy([2] + [0] * 8 + [2] + [0] * 5)
    choose = policy.choose
    policy.choose = lambda *args: (clock.__setitem__(0, clock[0] + 1000.0), choose(*args))[1]
    filed, observe = [], runner.cost_model.observe
    runner.cost_model.observe = lambda b, k, seconds, sampled: (filed.append((k, seconds)),
                                                               observe(b, k, seconds, sampled))[1]
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True))
    plain = [seconds for k, seconds in filed if k == 0]
    rounds = [seconds for k, seconds in filed if k]
    assert len(plain) >= 3 and rounds
    assert max(plain) < 1000 <= min(rounds)  # a round pays its choice: speculating asks one each step


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
    runner.policy = _SchedulePolicy([3, 0, 2, 0, 0, 3, 0, 0, 0, 4] + [0] * 6 + [2])
    catch_ups = []
    original = runner.draft._catch_up
    runner.draft._catch_up = lambda reqs: (reqs and catch_ups.append(len(reqs)), original(reqs))[1]
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert runner.draft.max_feed == 4
    # the first round prefills the prompts, then only the 6-step gaps need a prefill
    assert catch_ups and len(catch_ups) <= 1 + 40 // 17 + 1
    assert runner.stats.acceptance_rate >= 0.99


def test_ngram_tables_are_built_under_the_prefill(make_llm, ckpt_a, prompts):
    # a prompt's n-gram table is built while the prefill's forward runs (not before a decode
    # step's forward): the decode steps only extend it, and it goes with the request
    llm = _spec_llm(make_llm, ckpt_a, None, 1, method="ngram", max_num_batched_tokens=8)
    engine, proposer = llm.engine, llm.engine.runner.proposer
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


def test_tables_a_batched_lookup_queued_are_built_under_plain_steps(make_llm, ckpt_a, prompts, plain_outputs):
    # in a batch, a table that needs a build gives its request no draft and queues the build
    # (NgramProposer.ready / propose); with fixed K (no shadow drafts) the builds then run
    # under the plain steps' forwards (`_in_flight`), so speculation starts after a few
    # steps: here no table is built under the prefill at all. A step at which no request
    # can draft looks nothing up (`_speculative_decode`)
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
    runner = llm.engine.runner
    runner._prefill_in_flight = lambda requests: None
    proposer, any_ready_at_lookup, ready_at_decode = runner.proposer, [], []
    propose, decode = proposer.propose, runner._decode
    proposer.propose = lambda requests, ks: (any_ready_at_lookup.append(any(map(proposer.ready, requests))),
                                             propose(requests, ks))[1]
    runner._decode = lambda requests: (ready_at_decode.append(all(map(proposer.ready, requests))), decode(requests))[1]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert ready_at_decode[0] is False and True in ready_at_decode  # queued first, built later
    assert any_ready_at_lookup and all(any_ready_at_lookup)  # no lookup where none could draft
    assert runner.stats.drafts > 0 and not proposer.building
    assert llm.engine.leak_report() == []


def test_fixed_k_table_builds_do_not_depend_on_timing(make_llm, ckpt_a, prompts):
    # a fixed-K n-gram runner builds its tables whole, not only while the GPU is busy: which
    # requests can draft at a step (and so the uniforms a seeded sampled request draws) must
    # not depend on how long a forward took. Here the "GPU" is seen idle at once (one chunk
    # of a build a call), against a runner whose builds run whole: the same tokens
    from infer.spec.ngram import BUILD_CHUNK
    long = [(p * 20)[:200] for p in prompts]  # tables of several chunks each
    assert min(map(len, long)) > 2 * BUILD_CHUNK
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11 + i)
              for i in range(len(prompts))]
    outputs = []
    for idle_at_once in (False, True):
        llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
        runner = llm.engine.runner
        if idle_at_once:
            runner._busy = lambda: (lambda: False)
        outs = llm.generate(prompt_token_ids=long, sampling_params=params)
        outputs.append([o.outputs[0].token_ids for o in outs])
        assert runner.stats.drafts > 0 and llm.engine.leak_report() == []
    assert outputs[0] == outputs[1]


def test_steps_without_proposals_are_plain_steps(make_llm, ckpt_a, prompts, plain_outputs):
    # an n-gram proposer that finds no match proposes nothing: the step must be the plain
    # decode step (no verification pass), and the cost model must not file it at all: its
    # lookups would bias the plain baseline up
    from infer.spec.proposer import Draft
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
    runner = llm.engine.runner

    class Nothing:
        catch_up_seconds = 0.0

        def propose(self, requests, ks):
            return [Draft([], None) for _ in requests]

        def on_accepted(self, request, num_accepted):
            raise AssertionError("nothing was verified")

        def release(self, request):
            return None

    runner.proposer = Nothing()
    verified = []
    original = runner._verify
    runner._verify = lambda reqs, drafts: (verified.append(1), original(reqs, drafts))[1]
    choose, plain_choices = runner.policy.choose, []

    def counting(*args):
        ks = choose(*args)
        plain_choices.append(not any(ks))  # (the overflow guard gives K = 0 for last tokens)
        return ks

    runner.policy.choose = counting
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert not verified and runner.stats.rounds == 0
    assert runner.cost_model.version == 0  # nothing filed as speculative
    assert 0 < runner.cost_model.plain_version <= sum(plain_choices) < len(plain_choices)


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


def test_fused_draft_sampling_equals_the_general_path(make_llm, ckpt_a, random_draft, prompts, monkeypatch):
    # rows sampling with a temperature alone let the forward function sample (inside the CUDA
    # graph on a GPU); it must draw exactly what the general pipeline draws
    import infer.spec.draft_model as dm
    params = [SamplingParams(temperature=t, max_tokens=MAX_NEW, ignore_eos=True, seed=7 + i)
              for i, t in enumerate([0.8, 1.0, 0, 1.3])]
    results = []
    for fused in (True, False):
        llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 4)
        draft = llm.engine.runner.draft
        calls = []
        sample = draft.step_forward.sample
        draft.step_forward.sample = lambda *a: (calls.append(1), sample(*a))[1]
        if not fused:  # every row through logits_to_probs and sample_from_probs
            monkeypatch.setattr(dm, "temperature_only", lambda params, vocab: False)
        outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=params)
        stats = llm.engine.runner.stats
        results.append(([o.outputs[0].token_ids for o in outs], stats.draft_tokens, stats.accepted_tokens))
        assert bool(calls) == fused
    assert results[0] == results[1]
    assert results[0][2] > 0  # self-draft at a temperature: most drafts accepted


@pytest.mark.parametrize("temperatures", [[0, 0, 0, 0], [0.8, 1.0, 0, 1.3]])
def test_fused_draft_rounds_equal_step_by_step(make_llm, ckpt_a, prompts, temperatures):
    # a round whose rows all draft k tokens after feeds of one width runs as one `draft_loop`
    # (one CUDA graph replay on a GPU); it must draft exactly what the step-by-step loop drafts
    params = [SamplingParams(temperature=t, max_tokens=MAX_NEW, ignore_eos=True, seed=7 + i)
              for i, t in enumerate(temperatures)]
    results = []
    for fuse in (True, False):
        llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 4)
        draft = llm.engine.runner.draft
        draft.fuse_rounds = fuse
        loops = []
        loop = draft.step_forward.draft_loop
        draft.step_forward.draft_loop = lambda *a: (loops.append(a[2]), loop(*a))[1]
        outs = [o.outputs[0].token_ids for batch in (prompts[:4], prompts[4:5])
                for o in llm.generate(prompt_token_ids=batch, sampling_params=params[:len(batch)])]
        stats = llm.engine.runner.stats
        results.append((outs, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position))
        assert bool(loops) == fuse and set(loops) <= {K}
    assert results[0] == results[1]
    assert results[0][2] > 0  # self-draft: most drafts accepted


def test_graph_captures_are_not_timed_as_drafting(make_llm, ckpt_a, prompts, monkeypatch):
    # a draft round's graph is captured on its shape's first use: a one-off that must not
    # count as what drafting or the round costs (the adaptive policy would shun that K)
    import time
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([3])
    step = runner.draft.step_forward
    step.capture_seconds, clock = 0.0, [0.0]
    real_clock, loop = time.perf_counter, step.draft_loop

    def capturing_loop(*args):  # the first round "captures" for an hour
        if not step.capture_seconds:
            step.capture_seconds += 3600.0
            clock[0] += 3600.0
        return loop(*args)

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + clock[0])
    step.draft_loop = capturing_loop
    seen = []
    for name in ("observe", "observe_draft"):
        original = getattr(runner.cost_model, name)
        setattr(runner.cost_model, name,
                lambda b, k, seconds, sampled, original=original: (seen.append((k, seconds)),
                                                                   original(b, k, seconds, sampled))[1])
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    assert step.capture_seconds == 3600.0 and runner.stats.drafts > 1
    rounds = [seconds for k, seconds in seen if k]
    assert rounds and max(rounds) < 3600.0  # the injected hour is in no measured round (a threshold on the fake hour, not on speed)


def test_long_catch_ups_run_in_chunks(make_llm, ckpt_a, prompts, monkeypatch):
    # catch-ups are fed in chunks of at most CATCH_UP_CHUNK tokens per row (the Triton path on
    # a GPU); with a tiny chunk the prompts' lazy prefill and every gap take several chunks
    import infer.spec.draft_model as dm
    monkeypatch.setattr(dm, "CATCH_UP_CHUNK", 3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(ckpt_a, max_seq_len=256)
             .generate(prompt_token_ids=prompts[:2], sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 2)
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([3] + [0] * 9)
    widths, inside, counted = [], [], []
    model_forward, catch_up = runner.draft.model.forward, runner.draft._catch_up

    def forward(ids, *args, **kwargs):
        if inside:
            widths.append(ids.shape[1])
        return model_forward(ids, *args, **kwargs)

    def timed_catch_up(reqs):
        inside.append(1)
        before = len(widths)
        behind = [r.num_computed_tokens - runner.draft.pool.seq_len(runner.draft._slot(r)) for r in reqs]
        try:
            chunks = catch_up(reqs)
        finally:
            inside.clear()
        # the chunks reported to the cost model (summed over the requests), the forwards, and
        # the policy's prediction of each: the sum and the longest of the requests' units
        units = [runner.draft.catch_up_units(b) for b in behind]
        counted.append((chunks, len(widths) - before, sum(units), max(units, default=0)))
        return chunks

    runner.draft.model.forward, runner.draft._catch_up = forward, timed_catch_up
    outs = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert widths and max(widths) <= 3 and len(widths) > 10
    assert counted and all(c == total and forwards == longest for c, forwards, total, longest in counted), counted
    assert any(total > longest for _, _, total, longest in counted)  # two requests caught up at once
    assert runner.stats.acceptance_rate >= 0.99


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_catch_ups_padded_to_a_graph_width_match(make_llm, ckpt_a, prompts, monkeypatch, backend):
    # with CUDA graphs the catch-up chunks are right-padded to the captured width; padding
    # must write to the scratch row only. Stand-in on the CPU: a step function that "has a
    # graph" of the chunk width and runs it eagerly, padding included.
    import infer.spec.draft_model as dm
    from infer.cache.forward import EagerForward
    monkeypatch.setattr(dm, "CATCH_UP_CHUNK", 5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(ckpt_a, max_seq_len=256, kv_cache_backend=backend)
             .generate(prompt_token_ids=prompts[:3], sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 3, kv_cache_backend=backend, block_size=4)
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([3] + [0] * 7)
    draft = runner.draft
    padded = []

    class GraphLike:
        def __init__(self, forward):
            self.forward, self.eager = forward, EagerForward(draft.model, draft.pool)

        def supports(self, layout, all_logits):
            return layout.width == 5 and not all_logits

        def __call__(self, ids, layout, all_logits):
            if self.supports(layout, all_logits):
                assert ids.shape == (len(layout.slots), 5)
                padded.append(min(layout.chunk_lens) < 5)
                return self.eager(ids, layout, all_logits)
            return self.forward(ids, layout, all_logits)

    draft.step_forward = GraphLike(draft.step_forward)
    outs = llm.generate(prompt_token_ids=prompts[:3], sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert padded and any(padded)  # chunks ran at the graph width, some of them padded
    assert runner.stats.acceptance_rate >= 0.99  # the draft cache holds exactly the tokens
    assert llm.engine.leak_report() == []


def test_plain_stretches_time_one_step_in_a_sample_period_for_the_baseline(make_llm, ckpt_a, prompts):
    # a request kept plain decodes in plain stretches; one stretch step in PLAIN_SAMPLE_EVERY
    # (never a stretch's first) is filed as the plain step's cost, and the step after a
    # stretch is not timed for being one
    from infer.engine.speculative_runner import PLAIN_SAMPLE_EVERY
    llm = _spec_llm(make_llm, ckpt_a, None, 4, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    runner.policy.switch_margin = runner.policy.stay_margin = 1e9  # never speculates: long stretches
    runner.policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    stretches, timed, filed = [], [], []
    on_leave, on_timed, observe = runner._stretch.on_leave, runner._stretch.on_timed, runner.cost_model.observe
    runner._stretch.on_leave = lambda steps: (stretches.append(steps), on_leave(steps))
    runner._stretch.on_timed = lambda requests, seconds: (timed.append(seconds), on_timed(requests, seconds))
    runner.cost_model.observe = lambda b, k, s, sampled: (filed.append((k, s)), observe(b, k, s, sampled))
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(temperature=0, max_tokens=120,
                                                                              ignore_eos=True))
    assert max(stretches) >= PLAIN_SAMPLE_EVERY
    assert len(timed) == sum(n // PLAIN_SAMPLE_EVERY for n in stretches) >= 1
    assert [s for _, s in filed if s in timed] == timed and all(k == 0 for k, _ in filed)
    assert runner.stats.drafts == 0 and llm.engine.leak_report() == []


def test_plain_steps_outside_stretches_are_timed_only_while_the_baseline_needs_it(make_llm, ckpt_a, prompts):
    # the plain path stays thin: the policy's baseline needs a recent median, not every step
    from infer.engine.speculative_runner import PLAIN_RESAMPLE_EVERY
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 1)
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([0])
    timed = []
    observe = runner.cost_model.observe
    runner.cost_model.observe = lambda b, k, s, sampled: (timed.append(runner._plain_steps), observe(b, k, s, sampled))
    llm.generate(prompt_token_ids=prompts[:1],
                 sampling_params=SamplingParams(temperature=0, max_tokens=201, ignore_eos=True))
    assert runner._plain_steps == 200  # the first token comes from the prefill
    assert timed == _timed_plain_steps(200, PLAIN_RESAMPLE_EVERY) == [1, 2, 66, 130, 194]
    assert runner.cost_model.has_plain(1)



def test_speculative_episodes_run_from_a_start_to_the_next_plain_decision(make_llm, ckpt_a, prompts):
    # an episode opens at a step where the adaptive policy starts speculating and closes at
    # the next standing all-plain decision or when the batch changes; it counts exactly the
    # decode steps in between (their tokens), and the policy hears each one, measured in
    # plain steps, with the prediction of the step that opened it
    llm = _spec_llm(make_llm, ckpt_a, None, 1, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    policy = runner.policy
    runner.cost_model.relative_costs = lambda batch, sampled: [1.0] * (K + 1)  # speculate whenever a draft exists
    policy.calibration = None  # (kept so: the accounting is under test, not its effect)
    policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    steps = []  # (episode after the step, tokens it emitted, whether its choice started speculating)
    heard, started = [], []
    inner, observe, choose = runner._speculative_decode, policy.observe_episode, policy.choose

    def choosing(*args):
        ks = choose(*args)
        started.append(policy._choice is not None)  # (kept only when some request speculates)
        return ks

    starts = []  # per step: whether it called `policy.started`, and whether it verified drafts
    policy_started = policy.started

    def stepping(requests, plain_reserved=False):
        started.clear()
        calls, drafts = len(starts), runner.stats.drafts
        outputs = inner(requests, plain_reserved)
        steps.append((runner._episode, len(outputs), started == [True]))
        if len(starts) > calls:
            assert runner.stats.drafts > drafts  # speculation "started" (shadow patience) only with a round
        return outputs

    policy.started = lambda *args: (starts.append(args), policy_started(*args))[1]

    def hearing(*args):
        heard.append(args)
        observe(*args)

    runner._speculative_decode, policy.observe_episode, policy.choose = stepping, hearing, choosing
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # (long enough to fall into loops)
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert runner._episode is None  # the batch changed at the end of each request
    episodes = list({id(e): e for e, *_ in steps if e is not None}.values())
    assert len(episodes) > len(prompts) and runner.stats.drafts > 0  # (some closed by a plain decision)
    for e in episodes:
        own = [(tokens, starts) for x, tokens, starts in steps if x is e]
        assert e.steps == len(own) and e.tokens == sum(t for t, _ in own) >= e.steps
        assert own[0][1]  # opened by a choice that started speculating (its lookup may miss)
        assert e.seconds > 0 and e.gain > 0 and e.batch_size == 1 and not e.sampled
    opening = [i for i, (e, _, _) in enumerate(steps) if e is not None and (i == 0 or steps[i - 1][0] is not e)]
    assert all(steps[i][2] for i in opening)
    assert len(heard) == len(episodes)  # each closed once
    assert 0 < len(starts) <= len(episodes) and all(args == (1, False) for args in starts)
    plain = runner.cost_model.step_seconds(1, 0, False)
    last = episodes[-1]
    plain_steps, realized, predicted = heard[-1][2:]
    assert heard[-1][:2] == (1, False) and realized == last.tokens
    assert predicted == pytest.approx(last.gain * plain_steps)
    assert plain_steps == pytest.approx(last.seconds / plain, rel=0.5)  # (the baseline may move by then)
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("losing", [True, False])
def test_an_episode_found_losing_is_ended_after_a_few_steps(make_llm, ckpt_a, prompts, monkeypatch, losing):
    # once an episode has run EPISODE_CHECK_STEPS steps, the runner ends it (the policy hears
    # it) as soon as it is found losing (`Episode.losing`, tests/unit/test_episodes.py): here
    # every episode is, or none
    from infer.spec.episodes import Episode
    monkeypatch.setattr(Episode, "losing", lambda self, plain_seconds: losing)
    llm = _spec_llm(make_llm, ckpt_a, None, 1, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    policy = runner.policy
    runner.cost_model.relative_costs = lambda batch, sampled: [1.0] * (K + 1)  # speculate whenever a draft exists
    policy.calibration = None
    policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    ended, heard = [], []  # each episode's steps as it ends; what the policy heard
    end, observe = runner._end_episode, policy.observe_episode

    def ending():
        if runner._episode is not None:
            ended.append(runner._episode.steps)
        end()

    runner._end_episode = ending
    policy.observe_episode = lambda *args: (heard.append(args), observe(*args))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # (long enough to fall into loops)
    for p in prompts:
        llm.generate(prompt_token_ids=[p], sampling_params=params)
    assert ended and runner.stats.drafts > 0 and len(heard) == len(ended)
    if losing:  # (shorter ones met a plain decision or the request's end first)
        assert max(ended) == EPISODE_CHECK_STEPS
    else:
        assert max(ended) > EPISODE_CHECK_STEPS
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_steps_beside_prefill_chunks_are_not_filed_as_costs(make_llm, ckpt_a, prompts, plain_outputs, method):
    # a decode step that shares its engine step with prefill chunks waits for their GPU work
    # too: neither a plain step nor a round is filed in the cost model then (nor is an
    # episode that had such a step reported: tests/unit/test_episodes.py)
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a, 8, method=method, spec_policy="adaptive",
                    **ENGINE_CONFIGS["paged-prefix-small-chunks"])
    runner = llm.engine.runner
    filed, mixed_steps = [], []
    observe, step = runner.cost_model.observe, runner.step

    def stepping(prefill, decode):
        mixed_steps.append(bool(prefill) and bool(decode))
        return step(prefill, decode)

    runner.cost_model.observe = lambda *args: (filed.append(runner._mixed), observe(*args))[1]
    runner.step = stepping
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert sum(mixed_steps) >= 3  # decode steps did run beside prefill chunks
    assert filed and not any(filed)  # costs were filed, never from those
    assert runner._held == 0
    assert llm.engine.leak_report() == []


def test_no_shadow_drafts_nor_table_upkeep_where_no_k_could_pay(make_llm, ckpt_a, prompts, plain_outputs):
    # where the policy's costs say no K would pay even at its optimistic acceptance, shadow
    # evidence cannot make a request speculate: no shadows are taken and the n-gram tables
    # are not kept up (neither at prefill nor in plain steps); once a K could pay again the
    # tables catch up at their next lookup and the drafts are the ones a kept-up table gives
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    policy = runner.policy
    takes, synced, take, sync = [], [], runner.shadow.take, runner.proposer._sync
    runner.shadow.take = lambda *a: (takes.append(1), take(*a))[1]
    runner.proposer._sync = lambda r, limit=None: (synced.append(r.request_id), sync(r, limit))[1]
    policy.switch_margin = policy.stay_margin = 1e9  # nothing pays by these margins, at any acceptance
    policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert runner.stats.drafts == 0
    assert takes  # (the first steps, before any cost table is known)
    assert policy._table and all(not t.could_pay for t in policy._table.values())
    takes.clear()
    synced.clear()
    outs = _run(llm, prompts, 8)  # the tables are known now: nothing at all
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert takes == [] and synced == []
    policy.switch_margin, policy.stay_margin = 0.05, 0.0  # a K could pay again
    policy._table.clear()
    shadowed = runner.proposer.propose
    drafts = []
    runner.proposer.propose = lambda rs, ks: (d := shadowed(rs, ks), drafts.append(
        [(r.request_id, r.num_tokens, r.num_tokens - runner.proposer._entries[r.request_id].synced)
         for r, k in zip(rs, ks, strict=True) if k]), d)[0]  # (a request given k = 0 is not looked up)
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert takes and any(drafts) and all(behind == 0 for ds in drafts for _, _, behind in ds)  # caught up at each lookup
    assert runner._held == 0  # (the count that sizes a prefill's batch: every request gave its slot back)
    assert llm.engine.leak_report() == []


@pytest.fixture
def fake_clock(monkeypatch):
    """The runner's and the plain stretches' perf_counter, moved only by the test."""
    import infer.engine.plain_stretch as plain_stretch
    import infer.engine.speculative_runner as speculative_runner

    class Clock:
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            return cls.now

    monkeypatch.setattr(speculative_runner, "time", Clock)
    monkeypatch.setattr(plain_stretch, "time", Clock)
    return Clock


def _plain_shadowing_llm(make_llm, ckpt_a):
    """An n-gram adaptive engine (batch 8) that never speculates and takes shadows at every
    step, with the plain step costs and the upkeep reports its cost model hears."""
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    runner.policy.switch_margin = runner.policy.stay_margin = 1e9  # plain steps only
    runner.policy.worth_shadowing = lambda batch, sampled: True  # shadows at every step
    runner.policy.table_pays = lambda *args: True  # and tables for every request
    runner.policy = runner.policy  # (the runner binds the policy's hooks when it is set)
    plain, observe = [], runner.cost_model.observe
    runner.cost_model.observe = lambda b, k, seconds, sampled=False: (plain.append(seconds) if k == 0 else None,
                                                                     observe(b, k, seconds, sampled))[1]
    upkeep, observe_upkeep = [], runner.cost_model.observe_upkeep
    runner.cost_model.observe_upkeep = lambda b, seconds, sampled=False: (upkeep.append(seconds),
                                                                          observe_upkeep(b, seconds, sampled))[1]
    return llm, runner, plain, upkeep


def test_the_plain_baseline_leaves_shadow_upkeep_out(make_llm, ckpt_a, prompts, plain_outputs, fake_clock):
    # a timed plain step's shadow drafts and table upkeep are not plain decoding's cost in a
    # batch (its plain requests pay them whichever is chosen): on a
    # clock that moves only while shadows are taken, checked or kept up, every plain step the
    # cost model hears of costs nothing (before, those steps carried the upkeep: at W2 on the
    # H200, 25 % of a step, and 23 ms when 32 tables were built in one step)
    Clock = fake_clock  # noqa: N806
    llm, runner, plain, upkeep = _plain_shadowing_llm(make_llm, ckpt_a)

    def costing(fn):
        def timed(*args):
            Clock.now += 1.0  # a second of upkeep
            return fn(*args)
        return timed

    runner.shadow.take, runner.shadow.check = costing(runner.shadow.take), costing(runner.shadow.check)
    runner._keep_up = costing(runner._keep_up)
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert Clock.now > 0 and len(plain) >= 3  # upkeep ran, plain steps were timed (in stretches too)
    assert plain == [0.0] * len(plain)
    # what it cost instead: each stretch's mean a step (a check and a take each step, the
    # tables' upkeep every KEEP_UP_EVERY steps), what the shadow gate weighs
    assert upkeep and all(2.0 <= x <= 3.0 for x in upkeep), upkeep
    # alone, a request that speculates takes no shadows: its plain steps carry their upkeep
    plain.clear()
    out = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)[0]
    assert out.outputs[0].token_ids == plain_outputs[0]
    assert plain and all(seconds >= 1.0 for seconds in plain), plain


def test_an_aborted_request_gives_its_slot_back_to_the_prefill_batch_count(make_llm, ckpt_a, prompts):
    # an abort releases a running request twice (the scheduler's removal, then the engine's
    # own release): the count of requests holding a slot (the batch size the n-gram tables'
    # prefill upkeep is judged at) falls once
    llm = _spec_llm(make_llm, ckpt_a, None, 4, method="ngram", spec_policy="adaptive")
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts[:3]]
    for _ in range(3):
        engine.step()
    assert runner._held == 3
    assert engine.abort(reqs[1].request_id) is not None
    assert runner._held == 2
    while engine.has_unfinished():
        engine.step()
    assert runner._held == 0 and engine.leak_report() == []


@pytest.mark.parametrize("busy_asks", [2, 0])
def test_table_builds_spread_over_the_forwards_while_the_gpu_is_busy(make_llm, ckpt_a, prompts, plain_outputs,
                                                                      busy_asks):
    # n-gram tables are built under forwards only while the GPU still works (`_busy`, here a
    # fake saying busy `busy_asks` times a forward: 3 BUILD_CHUNK-token chunks, or the one a
    # call always builds where the forward ended before the call, batch 1 on the H200): what
    # is left waits for the next forwards, shadow drafts wait for their tables (no lookup
    # builds one on the critical path), every request gets its table and its shadows in the
    # end, the tokens are plain decoding's
    import infer.spec.ngram as ngram
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    proposer = runner.proposer
    runner.policy.switch_margin = runner.policy.stay_margin = 1e9  # plain steps only: shadows go on
    runner.policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    runner.policy.worth_shadowing = lambda batch, sampled: True
    runner.policy.table_pays = lambda *args: True  # (every request's table, whatever the CPU's costs)
    runner.policy = runner.policy
    runner.shadow.interval = 2
    # (222 prompt tokens: ~5 forwards at 3 chunks of 16, ~7 at one of 32)
    old_chunk, ngram.BUILD_CHUNK = ngram.BUILD_CHUNK, 16 if busy_asks else 32
    forwards = []

    def busy_for():
        left = [busy_asks]
        forwards.append(left)

        def busy():
            left[0] -= 1
            return left[0] >= 0
        return busy

    runner._busy = busy_for
    looked_up, propose = [], proposer.propose
    proposer.propose = lambda requests, ks: (looked_up.extend((r.request_id, proposer.ready(r))
                                                              for r, k in zip(requests, ks) if k),
                                             propose(requests, ks))[1]
    building, step = [], llm.engine.step
    llm.engine.step = lambda: (step(), building.append(proposer.building))[0]
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    finally:
        ngram.BUILD_CHUNK = old_chunk
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    # left part-built at the prefill, finished later (builds starved of GPU time too)
    assert building[0] and not building[len(building) // 2 if busy_asks else -1]
    assert len(forwards) > 2 and all(left[0] < 0 for left in forwards[:2])  # each build stopped when told
    assert all(ready for _, ready in looked_up)  # no lookup of a table not ready
    assert len({rid for rid, _ in looked_up}) == len(prompts)  # yet every request had shadow lookups
    assert runner.stats.drafts == 0 and llm.engine.leak_report() == []


@pytest.mark.parametrize("gpu_busy", [True, False])
def test_table_builds_are_upkeep_only_where_the_gpu_did_not_hide_them(make_llm, ckpt_a, prompts, plain_outputs,
                                                                    fake_clock, monkeypatch, gpu_busy):
    # tables queued for building go on under the next forwards while the GPU works. Time
    # the GPU's work hid costs no step: neither left out of a timed plain step (which would
    # then look cheaper by work it did not wait for) nor reported as a stretch's upkeep. Time
    # spent once the GPU was idle (a host-bound step: W2 on the H100) is upkeep like the
    # shadows': reported, and left out of the timed plain steps. On a clock that moves only
    # while tables are built, with the GPU busy throughout (each build runs whole) or idle
    # from the start (one chunk a call: many steps), the time lands on one side only
    import infer.spec.ngram as ngram
    Clock = fake_clock  # noqa: N806
    monkeypatch.setattr(ngram, "BUILD_CHUNK", 16)
    llm, runner, plain, upkeep = _plain_shadowing_llm(make_llm, ckpt_a)
    runner._busy = lambda: (lambda: gpu_busy)
    runner._prefill_in_flight = lambda requests: None  # no builds at the prefill: all in decode steps
    keep_up, builds = runner._keep_up, []

    def building(requests, busy=None):
        if busy is not None and runner.proposer.building:
            Clock.now += 100.0
            builds.append(1)
        return keep_up(requests, busy)

    runner._keep_up = building
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert len(builds) >= (1 if gpu_busy else 3)  # tables were built under forwards (over many steps when idle)
    if gpu_busy:
        assert any(seconds >= 100 for seconds in plain)  # timed plain steps carry the hidden builds
        assert all(seconds < 100 for seconds in upkeep)  # the upkeep reports do not
    else:
        assert all(seconds < 100 for seconds in plain)  # timed plain steps leave exposed builds out
        assert any(seconds >= 100 / 8 for seconds in upkeep)  # a stretch's upkeep carries them
    assert not runner.proposer.building and llm.engine.leak_report() == []


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_plain_decisions_kept_through_finishes_and_preemptions_keep_the_tokens(make_llm, ckpt_a, prompts, method):
    # a request leaving under a standing all-plain decision (finished, or preempted while
    # the scheduler reserves a step) keeps the decision for the rest: the tokens stay plain
    # decoding's, every slot and block comes back, and the decision was kept at least once
    params = [SamplingParams(temperature=0, max_tokens=40 - 3 * i, ignore_eos=True) for i in range(8)]
    kw = dict(kv_cache_backend="paged", block_size=4, num_blocks=48, max_num_batched_tokens=16)
    plain = make_llm(ckpt_a, max_batch_size=8, max_seq_len=256, **kw)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = _spec_llm(make_llm, ckpt_a, ckpt_a if method == "draft_model" else None, 8, method=method,
                    spec_policy="adaptive", **kw)
    runner = llm.engine.runner
    runner.policy.switch_margin = runner.policy.stay_margin = 1e9
    runner.policy.ledger = None  # (timing-free: the loss ledger would judge this CPU's real steps)
    kept, keep = [], runner._keep_quiet_without
    runner._keep_quiet_without = lambda r: (k := keep(r), kept.append((k, r.is_finished)))[0]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(k for k, _ in kept)
    assert any(not finished for _, finished in kept)  # preemptions happened under plain decisions
    assert runner._held == 0 and llm.engine.leak_report() == []


class _FirstSpeculates(_SchedulePolicy):
    """The batch's first request drafts `k` tokens at every step, the others none: every
    decode step is a round."""

    def __init__(self, k):
        super().__init__([k])

    def choose(self, requests, seq_lens, max_seq_len, tokens_left):
        return [min(self.cycle[0], max(0, tokens_left[0] - 1))] + [0] * (len(requests) - 1)


def test_table_builds_go_on_under_rounds_too(make_llm, ckpt_a, prompts, plain_outputs, monkeypatch):
    # tables left part-built at the prefill go on under the verification forwards of rounds
    # too (here the first request asks for a draft at every step; the others wait for their
    # tables), with the tokens plain decoding's
    import infer.spec.ngram as ngram
    monkeypatch.setattr(ngram, "BUILD_CHUNK", 16)
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    runner.policy = _FirstSpeculates(3)
    runner._busy = lambda: (lambda: False)  # one chunk a call
    in_verify, built, verify, build = [False], [], runner._verify, runner._build_tables

    def verifying(*args):
        in_verify[0] = True
        try:
            return verify(*args)
        finally:
            in_verify[0] = False

    runner._verify = verifying
    runner._build_tables = lambda requests: (seconds := build(requests),
                                             built.append(in_verify[0] and seconds is not None), seconds)[-1]
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert runner.stats.drafts > 0 and any(built)  # some builds ran under a round's forward
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("pays", [False, True])
def test_tables_only_for_requests_whose_speculation_can_pay_for_them(make_llm, ckpt_a, prompts, plain_outputs,
                                                                    pays):
    # the adaptive n-gram runner asks the policy (`table_pays`) before it builds a request's
    # table, with the batch the request decodes in, the tokens it may still emit, the tokens
    # its table would index and what a table costs a token; turned down, a request gets no
    # table (no build under a forward, no lookup, no shadow draft) and decodes plainly
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram", spec_policy="adaptive")
    runner = llm.engine.runner
    asked, syncs, sync = [], [], runner.proposer._sync
    runner.policy.table_pays = lambda *args: (asked.append(args), pays)[1]
    runner.policy = runner.policy  # (the runner binds the policy's hooks when it is set)
    runner.proposer._sync = lambda request, limit=None: (syncs.append(request.request_id), sync(request, limit))[1]
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert asked and all(1 <= batch <= 8 and not sampled and 0 <= left <= 256 and 0 < indexed <= 256 and cost > 0
                         for batch, sampled, left, indexed, cost in asked)
    assert any(batch == 8 for batch, *_ in asked)  # the batch held when the prompts came
    assert bool(syncs) == pays  # turned down: no table was ever built or synced
    if not pays:
        assert runner.stats.drafts == 0
    assert runner.proposer.leak_report() == [] and llm.engine.leak_report() == []


@pytest.mark.parametrize("between", [0.25, 5.0])
def test_a_steps_cost_includes_the_loop_until_the_next_step(make_llm, ckpt_a, prompts, plain_outputs, fake_clock,
                                                             between):
    # a decode step's measured cost is extended by the time until the next step starts (its
    # retirement, the next step's scheduling: a round retires 2-3x the tokens and reserves
    # K + 1 positions), unless that time is longer than the step itself (an idle engine).
    # On a clock that moves 1 s in each decode and `between` in each scheduling, rounds and
    # timed plain steps are filed at 1 + 0.25, or at 1 when the scheduling took 5 s
    Clock = fake_clock  # noqa: N806
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
    runner = llm.engine.runner
    runner.policy = _SchedulePolicy([2, 0, 0])
    accept, schedule = runner._accept, llm.engine.scheduler.schedule
    runner._accept = lambda *args: (setattr(Clock, "now", Clock.now + 1.0), accept(*args))[1]
    runner._in_flight = lambda requests: setattr(Clock, "now", Clock.now + 1.0)  # plain steps' decode
    llm.engine.scheduler.schedule = lambda r: (setattr(Clock, "now", Clock.now + between), schedule(r))[1]
    filed = []
    observe, extend = runner.cost_model.observe, runner.cost_model.extend_latest
    runner.cost_model.observe = lambda b, k, seconds, sampled=False: (filed.append([k, seconds]),
                                                                      observe(b, k, seconds, sampled))[1]

    def extending(b, k, seconds, sampled=False):
        assert filed[-1][0] == k  # (the step just filed)
        filed[-1][1] += seconds
        extend(b, k, seconds, sampled)

    runner.cost_model.extend_latest = extending
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    rounds = [seconds for k, seconds in filed if k]
    plain = [seconds for k, seconds in filed if not k]
    assert len(rounds) >= 3 and plain
    expected = 1.25 if between < 1.0 else 1.0
    # (the last has no next step; the n-gram catch-up, on the real clock, is taken off rounds)
    assert all(s == pytest.approx(expected, abs=1e-2) for s in rounds[:-1] + plain[:-1])
    samples = [x for (tag, key), xs in runner.cost_model._samples.items() if tag == "step" and key[1] for x in xs]
    assert samples and all(s == pytest.approx(expected, abs=1e-2) for s in samples[:-1])  # the cost model's
    assert llm.engine.leak_report() == []


class _ChargedSchedulePolicy(_QuietSchedulePolicy):
    """The quiet cycle, hearing the loss ledger's charges (`AdaptivePolicy.charge`)."""

    def __init__(self, cycle):
        super().__init__(cycle)
        self.charges = []

    def charge(self, batch_size, sampled, lost, plain=None):
        self.charges.append((batch_size, lost))


def test_steps_outside_plain_stretches_are_charged_their_cost_beyond_plain_worth(make_llm, ckpt_a, prompts,
                                                                                plain_outputs, fake_clock):
    # the loss ledger (spec/loss_ledger.py) hears of every decode step the policy decided
    # (not one a standing plain decision covered): its time less its tokens' worth at the
    # plain step's cost, then the time it held the loop until the next step. On a clock
    # that moves 1 s in each decode and 0.25 s in each scheduling, plain steps priced 0.5 s
    Clock = fake_clock  # noqa: N806
    llm = _spec_llm(make_llm, ckpt_a, None, 8, method="ngram")
    runner = llm.engine.runner
    runner.policy = policy = _ChargedSchedulePolicy([2, 0, 0])
    runner.cost_model.step_seconds = lambda b, k, sampled=False: 0.5 if k == 0 else None
    accept, schedule = runner._accept, llm.engine.scheduler.schedule
    runner._accept = lambda *args: (setattr(Clock, "now", Clock.now + 1.0), accept(*args))[1]
    runner._in_flight = lambda requests: setattr(Clock, "now", Clock.now + 1.0)
    llm.engine.scheduler.schedule = lambda r: (setattr(Clock, "now", Clock.now + 0.25), schedule(r))[1]
    decided = []  # (batch, tokens) of each step through `choose`
    decide = runner._speculative_decode

    def recording(requests, *args):
        outputs = decide(requests, *args)
        decided.append((len(requests), len(outputs)))
        return outputs

    runner._speculative_decode = recording
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert len(decided) >= 6 and any(tokens > batch for batch, tokens in decided)  # rounds among them
    # each decided step: its charge, then the loop's 0.25 s (not after the last step)
    expected = []
    for batch, tokens in decided:
        expected += [(batch, 1.0 - tokens / batch * 0.5), (batch, 0.25)]
    assert [b for b, _ in policy.charges] == [b for b, _ in expected[:-1]]
    assert [lost for _, lost in policy.charges] == pytest.approx([lost for _, lost in expected[:-1]])
    # steps under the standing decision (the thin path) were not charged
    assert policy.i > len(decided)
    assert llm.engine.leak_report() == []


def test_a_plain_stretchs_shadow_upkeep_is_charged_to_the_loss_ledger(make_llm, ckpt_a, prompts, plain_outputs,
                                                                       fake_clock):
    # shadow drafts and table upkeep keep speculation possible at a cost plain decoding does
    # not pay: each stretch's upkeep is charged whole (not less a plain step's worth), as is
    # that of a thin-path step that took shadows
    Clock = fake_clock  # noqa: N806
    llm, runner, _, _ = _plain_shadowing_llm(make_llm, ckpt_a)

    def costing(fn):
        def timed(*args):
            Clock.now += 1.0
            return fn(*args)
        return timed

    runner.shadow.take, runner.shadow.check = costing(runner.shadow.take), costing(runner.shadow.check)
    stretches, leave = [], runner._stretch.on_leave
    runner._stretch.on_leave = lambda steps: (stretches.append(runner._stretch_upkeep), leave(steps))[1]
    whole, charge_upkeep = [], runner._charge_upkeep
    runner._charge_upkeep = lambda requests, seconds: (whole.append(seconds), charge_upkeep(requests, seconds))[1]
    outs = _run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    upkeep = [u for u in stretches if u]
    assert upkeep and all(u >= 2.0 for u in upkeep)  # (a check and a take a step at least)
    assert sorted(upkeep) == sorted(s for s in whole if s in upkeep) and len(whole) >= len(upkeep)
    assert runner.policy.ledger.loss((8, False)) >= sum(upkeep)  # (the ledger heard them)
    assert llm.engine.leak_report() == []
