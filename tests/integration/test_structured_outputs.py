"""Structured outputs end to end on the bundled demo pair (a byte-level BPE tokenizer of 8192
tokens): outputs under 50 varied JSON schemas parse and validate, greedy and sampled, with
and without speculation; greedy output under a grammar is the same with and without
speculation (draft model, n-gram, a tree); batches mix constrained and free requests; a bad
schema is refused at add_request."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from helpers.schemas import make_schemas  # noqa: E402
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from infer.sampling import SamplingParams, StructuredOutput  # noqa: E402

SCHEMAS = make_schemas(50, seed=7)
PROMPTS = ["A record as JSON: ", "def load(path):\n    ", "data = ", "{"]
MAX_TOKENS = 256

SPECULATION = {
    "plain": {},
    "draft": {"use_speculative_decoding": True, "draft_model": str(DEMO_DRAFT), "spec_length": 4},
    "ngram": {"use_speculative_decoding": True, "speculative_method": "ngram", "spec_length": 3},
    "tree": {"use_speculative_decoding": True, "draft_model": str(DEMO_DRAFT), "spec_tree": "2,1,1"},
}


def _llm(make_llm, mode: str):
    return make_llm(DEMO_TARGET, max_batch_size=16, max_seq_len=512, **SPECULATION[mode])


def _params(schema: dict, i: int, greedy: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0 if greedy else 0.9, top_p=1.0 if greedy else 0.95, seed=i,
                          max_tokens=MAX_TOKENS, structured=StructuredOutput(json=schema))


def _run_schemas(llm, greedy: bool) -> list:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    return llm.generate(prompts, [_params(s, i, greedy) for i, s in enumerate(SCHEMAS)])


def test_the_schemas_are_varied():
    texts = {json.dumps(s, sort_keys=True) for s in SCHEMAS}
    assert len(texts) == len(SCHEMAS)
    blob = "".join(texts)
    for feature in ('"pattern"', '"enum"', '"anyOf"', '"array"', '"integer"', '"number"', '"null"', '"const"'):
        assert feature in blob, feature
    assert any(json.dumps(p).count('"object"') for s in SCHEMAS for p in s["properties"].values())  # nesting


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "draft", "tree"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_outputs_validate_against_their_schema(make_llm, mode, greedy):
    outputs = _run_schemas(_llm(make_llm, mode), greedy)
    for schema, out in zip(SCHEMAS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("mode", ["draft", "ngram", "tree"])
def test_greedy_output_is_the_same_with_speculation(make_llm, mode):
    schemas = SCHEMAS[:12]
    params = [_params(s, i, greedy=True) for i, s in enumerate(schemas)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    plain = _llm(make_llm, "plain").generate(prompts, params)
    spec_llm = _llm(make_llm, mode)
    spec = spec_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = spec_llm.engine.runner.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0  # speculation really ran


def test_regex_choice_and_grammar(make_llm):
    llm = _llm(make_llm, "draft")
    specs = {
        "regex": StructuredOutput(regex=r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)"),
        "choice": StructuredOutput(choice=["yes", "no", 'say "maybe"\\later']),
        "grammar": StructuredOutput(grammar='root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [0-9] | "x"'),
        "json_object": StructuredOutput(json_object=True),
    }
    # sampled, but json_object greedily: any object allows strings a random model may never close
    outs = llm.generate(["def f():\n    "] * len(specs),
                        [SamplingParams(temperature=0.0 if name == "json_object" else 0.8, seed=3,
                                        max_tokens=MAX_TOKENS, structured=s) for name, s in specs.items()])
    text = {name: o.outputs[0].text for name, o in zip(specs, outs, strict=True)}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), text
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)", text["regex"])
    assert text["choice"] in ("yes", "no", 'say "maybe"\\later')
    assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x)){0,2}\)", text["grammar"])
    assert isinstance(json.loads(text["json_object"]), dict)


def test_mixed_batch_leaves_free_requests_unchanged(make_llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    constrained = _params(SCHEMAS[0], 0, greedy=True)
    prompts = ["def add(a, b):\n    ", "A record: ", "for i in range(3):\n    "]
    for mode in ("plain", "draft"):
        llm = _llm(make_llm, mode)
        alone = llm.generate([prompts[0], prompts[2]], [free, free])
        mixed = llm.generate(prompts, [free, constrained, free])
        assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == \
            [o.outputs[0].token_ids for o in alone]
        jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput(json={"type": "wat"}), "json"),
    (StructuredOutput(regex="(ab"), "regex"),
    (StructuredOutput(grammar='root ::= missing'), "grammar"),
])
def test_a_bad_spec_is_refused_before_queueing(make_llm, spec, words):
    llm = _llm(make_llm, "plain")
    with pytest.raises(ValueError, match=rf"invalid structured output \({words}\)"):
        llm.engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished()


def test_the_compiled_grammar_is_cached_per_spec(make_llm):
    llm = _llm(make_llm, "plain")
    spec = StructuredOutput(json=SCHEMAS[3])
    first = llm.engine.grammar(spec)
    again = llm.engine.grammar(StructuredOutput(json=json.dumps(SCHEMAS[3])))
    assert first is not again  # one matcher per request
    assert len(llm.engine.grammars.cache) == 1  # one compiled grammar for equal specs


@pytest.mark.parametrize("mode", ["plain", "draft"])
def test_overlapped_scheduling_and_preemption_keep_the_grammar_in_step(make_llm, mode):
    # overlapped scheduling (the GPU default) must accept each token into the grammar before
    # the next step's mask; a preempted request keeps its grammar state over its re-prefill
    schemas = SCHEMAS[:8]
    params = [replace(_params(s, i, greedy=True), max_tokens=120) for i, s in enumerate(schemas)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    ref = _llm(make_llm, "plain").generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" for o in ref)
    llm = make_llm(DEMO_TARGET, max_batch_size=8, max_seq_len=512, async_scheduling=True, kv_cache_backend="paged",
                   block_size=4, num_blocks=36, max_num_batched_tokens=16, **SPECULATION[mode])
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.scheduler.num_preemptions > 0, "pool was meant to be small enough to preempt"


def test_n_samples_each_follow_the_grammar(make_llm):
    schema = SCHEMAS[5]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, structured=StructuredOutput(json=schema))
    out = _llm(make_llm, "draft").generate(["A record as JSON: "], params)[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1  # independent samples
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_draft_model_proposes_only_tokens_the_grammar_allows(make_llm, monkeypatch):
    from infer.engine.verification import Verification
    from infer.speculative.grammar_mask import allocate_bitmask, allowed_tokens

    checked = []
    real_block = Verification.block

    def spy(self, requests, drafts, follows=None):
        for r, d in zip(requests, drafts, strict=True):
            if r.grammar is None:
                continue
            tokens = [t for t, ok in zip(d.token_ids, d.valid, strict=True) if ok]
            for i, t in enumerate(tokens):
                bitmask = allocate_bitmask(1, r.grammar.vocab_size)
                r.grammar.fill_after(bitmask, 0, tokens[:i])
                checked.append(bool(allowed_tokens(bitmask, r.grammar.vocab_size)[0, t]))
        return real_block(self, requests, drafts, follows)

    monkeypatch.setattr(Verification, "block", spy)
    llm = _llm(make_llm, "draft")
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=24)
    outs = llm.generate(["A record: ", "data = ", "def f(x):\n    "],
                        [_params(SCHEMAS[1], 1, greedy=True), _params(SCHEMAS[2], 2, greedy=False), free])
    assert len(checked) > 20 and all(checked)
    for schema, out in zip(SCHEMAS[1:3], outs, strict=False):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.runner.stats.acceptance_rate > 0.3  # masked drafts are mostly accepted
