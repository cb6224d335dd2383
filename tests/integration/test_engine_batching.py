"""Batch invariance of the serving engine (fp32, CPU).

Greedy outputs of 16 prompts of different lengths generated concurrently must equal those
generated one at a time, for both KV backends, prefix caching on and off, chunked prefill
forced to tiny chunks, and a pool so small that preemption happens. The one-at-a-time
reference is itself checked against transformers' `generate`.
"""

from __future__ import annotations

import random

import pytest

from helpers.checkpoints import encode, hf_greedy, load_hf_model
from infer import SamplingParams

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(model_dir, n: int = 16) -> list[list[int]]:
    rng = random.Random(7)
    words = "the quick brown fox jumps over lazy dog cat sat on mat def forward return model".split()
    shared = encode(model_dir, "The quick brown fox jumps over the lazy dog while the cat")
    prompts = []
    for i in range(n):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = encode(model_dir, body)
        prompts.append(shared + ids[1:] if i % 3 == 0 else ids)  # a third share a long prefix
    return prompts


@pytest.fixture(scope="module")
def reference(ckpt_a):
    prompts = _prompts(ckpt_a)
    hf = load_hf_model(ckpt_a)
    return prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _one_at_a_time(llm, prompts):
    return [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].outputs[0].token_ids for p in prompts]


def _ref_prefix(refs):
    # hf_greedy stops at EOS; we ignore EOS, so compare up to the reference's length
    return refs


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_one_at_a_time_matches_transformers(make_llm, ckpt_a, reference, backend):
    prompts, refs = reference
    llm = make_llm(ckpt_a, kv_cache_backend=backend, max_batch_size=4, max_seq_len=256)
    got = _one_at_a_time(llm, prompts)
    for g, r in zip(got, refs, strict=True):
        assert g[:len(r)] == r


CONFIGS = {
    "contiguous": dict(kv_cache_backend="contiguous"),
    # 4 at a time, so later requests arrive after earlier prompts entered the prefix tree
    "paged-prefix": dict(kv_cache_backend="paged", enable_prefix_caching=True, max_batch_size=4),
    "paged-noprefix": dict(kv_cache_backend="paged", enable_prefix_caching=False),
    "paged-tiny-chunks": dict(kv_cache_backend="paged", max_num_batched_tokens=5, block_size=4),
    "contiguous-tiny-chunks": dict(kv_cache_backend="contiguous", max_num_batched_tokens=3),
    "paged-preempt": dict(kv_cache_backend="paged", block_size=4, num_blocks=40, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_equals_one_at_a_time(make_llm, ckpt_a, reference, name):
    prompts, refs = reference
    llm = make_llm(ckpt_a, **{"max_batch_size": 16, "max_seq_len": 256, **CONFIGS[name]})
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for out, r in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids[:len(r)] == r
        assert len(out.outputs[0].token_ids) == MAX_NEW
    if name == "paged-preempt":
        assert llm.engine.scheduler.num_preemptions > 0, "pool was meant to be small enough to preempt"
    if name == "paged-prefix":
        assert llm.engine.runner.cache_pool.prefix_hit_rate > 0


def test_static_batching_same_outputs(make_llm, ckpt_a, reference):
    prompts, refs = reference
    llm = make_llm(ckpt_a, max_batch_size=4, max_seq_len=256, batching_mode="static")
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for out, r in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids[:len(r)] == r


def test_abort_mid_generation_frees_everything(make_llm, ckpt_a, reference):
    prompts, _ = reference
    llm = make_llm(ckpt_a, max_batch_size=4, max_seq_len=256, block_size=4)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in prompts[:6]]
    for _ in range(4):
        engine.step()
    assert any(r.output_token_ids for r in reqs)
    for r in reqs:
        out = engine.abort(r.request_id)
        assert out is not None and out.finished and out.finish_reason.value == "abort"
    assert not engine.has_unfinished()
    assert engine.leak_report() == []
    assert engine.abort(reqs[0].request_id) is None  # aborting twice is harmless


def test_sampled_decode_through_the_tensor_sampler_equals_the_general_pipeline(make_llm, ckpt_a, monkeypatch):
    # rows that sample with a temperature alone take the tensor sampler (`sample_logits`, no
    # host-side branching); with that route turned off, every row goes through
    # `logits_to_probs` and `sample_from_probs`: seeded tokens must be the same
    import infer.engine.runner as runner_module

    prompts = _prompts(ckpt_a, n=6)
    params = [SamplingParams(temperature=t, max_tokens=MAX_NEW, ignore_eos=True, seed=11 + i)
              for i, t in enumerate([0.7, 1.0, 0.0, 1.3, 1.0, 0.5])]
    fused = make_llm(ckpt_a, max_batch_size=8)
    calls = []
    sample = runner_module.sample_logits
    monkeypatch.setattr(runner_module, "sample_logits", lambda *a: (calls.append(a[0].shape[0]), sample(*a))[1])
    got = [o.outputs[0].token_ids for o in fused.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert calls and max(calls) > 1  # batched sampled steps took the tensor sampler
    monkeypatch.undo()
    general = make_llm(ckpt_a, max_batch_size=8)
    monkeypatch.setattr(runner_module, "temperature_only", lambda params, vocab: False)
    want = [o.outputs[0].token_ids for o in general.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert len({tuple(t) for t in got}) == len(got)  # the seeds really differ
