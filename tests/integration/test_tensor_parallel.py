"""Tensor parallelism on the CPU (gloo, 2 processes): the same tokens as one process.

The checkpoint has 8 query heads over 4 KV heads (each rank: 4 over 2, so grouped-query
attention inside a rank too), an MLP and a vocabulary that split in two. Each case runs the
same requests on an engine of one rank and on an engine of two and compares the tokens:
greedy with prefix caching and chunked prefill (and a second round of the same prompts,
served from the prefix cache), speculation with a draft model (whole on the driver, or
sharded) and with n-grams, seeded sampling (plain and speculative), FP8 weights with a
vocabulary-parallel embedding, a replicated lm_head. Every engine must end with no leak on
any rank (the workers report their pools), its workers exited 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import mixed_prompts
from infer import LLM, SamplingParams
from infer.cache.paged import PagedKVCachePool
from infer.distributed.channel import HEADER_BYTES

MAX_NEW = 14
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tp_ckpt: Path) -> list[list[int]]:
    """Six prompts: four share a 12-token start (prefix cache blocks of 4), one is long
    (chunked prefill at 8 tokens a step), one repeats itself (n-gram matches)."""
    return mixed_prompts(tp_ckpt, seed=11)


def _tokens(model: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            rounds: int = 1, **kwargs: Any) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """Token ids per round per prompt, and facts about the engine, from an engine closed after."""
    facts: dict[str, Any] = {}
    kwargs.setdefault("max_seq_len", 256)
    with LLM(str(model), device="cpu", **kwargs) as llm:
        out = [[o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
               for _ in range(rounds)]
        assert llm.engine.leak_report() == []  # every rank's pools, the workers' included
        runner, parallel = llm.engine.runner, llm.engine.parallel
        pool = runner.cache_pool if parallel is None else runner.cache_pool.local
        facts["prefix_hit_tokens"] = pool.prefix_hit_tokens if isinstance(pool, PagedKVCachePool) else None
        facts["stats"] = runner.stats
        facts["largest_message"] = parallel.channel.largest if parallel is not None else None
        facts["overlap"] = runner.overlap
        workers = parallel.workers if parallel is not None else ()
    assert [w.returncode for w in workers] == [0] * len(workers)  # closed: they left cleanly
    return out, facts


def _parity(model: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            rounds: int = 1, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    one, facts1 = _tokens(model, prompts, params, rounds, **kwargs)
    two, facts2 = _tokens(model, prompts, params, rounds, tensor_parallel_size=2, **kwargs)
    assert two == one
    assert all(len(t) == MAX_NEW for r in two for t in r)
    return facts1, facts2


def test_greedy_parity_with_prefix_caching_and_chunked_prefill(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    facts1, facts2 = _parity(tp_ckpt, prompts, GREEDY, rounds=2, kv_cache_backend="paged", block_size=4,
                             enable_prefix_caching=True, max_num_batched_tokens=8, max_batch_size=4)
    assert facts2["prefix_hit_tokens"] == facts1["prefix_hit_tokens"] > 100  # round 2 is mostly cached


@pytest.mark.parametrize("placement", ["driver", "sharded"])
def test_parity_draft_model_speculation(tp_ckpt: Path, tp_draft: Path, prompts: list[list[int]],
                                        placement: str) -> None:
    """Driver: an unrelated draft (most drafts rejected), greedy. Sharded: the target drafting
    for itself (whole rounds accepted, two-token feeds), greedy and seeded sampled rows.
    Lengths differ per row, so rows of one round draft different k near their ends (the
    step-by-step draft path beside the fused one)."""
    draft = tp_draft if placement == "driver" else tp_ckpt
    params = [SamplingParams(temperature=0.0 if placement == "driver" or i % 2 else 0.8, seed=40 + i,
                             max_tokens=MAX_NEW - (i % 3), ignore_eos=True) for i in range(len(prompts))]
    kw: dict[str, Any] = dict(use_speculative_decoding=True, draft_model=str(draft), spec_length=3, block_size=4,
                              max_num_batched_tokens=16)
    one, _ = _tokens(tp_ckpt, prompts, params, **kw)
    two, facts = _tokens(tp_ckpt, prompts, params, tensor_parallel_size=2, tensor_parallel_draft=placement, **kw)
    assert two == one
    assert facts["stats"].drafts > 0
    if placement == "sharded":
        assert facts["stats"].acceptance_rate > 0.9


def test_overlapped_steps_keep_parity(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    # overlapped scheduling (the default on GPUs): a step's message goes out with the step in
    # flight, its input ids still on the driver's device; greedy and seeded sampled rows,
    # n-gram speculation (its plain steps overlap too) against synchronous TP=1
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=60 + i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(prompts))]
    for kw in ({}, dict(use_speculative_decoding=True, speculative_method="ngram", spec_length=3,
                        spec_policy="adaptive", spec_cost_coefficient=0.0)):
        one, _ = _tokens(tp_ckpt, prompts, params, async_scheduling=False, **kw)
        two, facts = _tokens(tp_ckpt, prompts, params, tensor_parallel_size=2, async_scheduling=True, **kw)
        assert two == one and facts["overlap"]


def test_greedy_parity_ngram_speculation_contiguous_backend(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    # a 480-token prompt too: the prefill message (ids, int64) outgrows the control header (two broadcasts)
    long = (prompts[4] * 40)[:480]
    _, facts = _parity(tp_ckpt, [*prompts, long], GREEDY, use_speculative_decoding=True, speculative_method="ngram",
                       spec_length=3, kv_cache_backend="contiguous", max_seq_len=512)
    assert facts["stats"].drafts > 0
    assert facts["largest_message"] > HEADER_BYTES


def test_seeded_sampling_parity_with_replicated_lm_head(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, top_k=-1 if i % 3 else 40, seed=100 + i,
                             max_tokens=MAX_NEW, ignore_eos=True) for i in range(len(prompts))]
    _parity(tp_ckpt, prompts, params, tensor_parallel_lm_head="replicated")


def test_fp8_with_vocab_parallel_embedding_parity(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    # FP8 row-parallel layers take each row's scale over both ranks' columns: the same
    # quantized weights as one process; the tied lm_head shares the embedding's rows
    _parity(tp_ckpt, prompts, GREEDY, quantization="fp8", tensor_parallel_embedding="vocab_parallel")


def test_the_server_serves_a_tensor_parallel_engine(tp_ckpt: Path, prompts: list[list[int]]) -> None:
    # `infer serve --tensor-parallel-size 2`: the engine's steps run on the server's engine
    # thread; stopping the server ends the worker
    import httpx

    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine
    from infer.server.launch import LiveServer

    expected, _ = _tokens(tp_ckpt, prompts[:2], GREEDY)
    config = EngineConfig(model=str(tp_ckpt), device="cpu", max_seq_len=256, tensor_parallel_size=2)
    engine = Engine(config)
    parallel = engine.parallel
    assert parallel is not None
    with LiveServer.start(config, "tp", engine=engine) as live:
        for prompt, want in zip(prompts[:2], expected[0], strict=True):
            r = httpx.post(f"{live.url}/v1/completions", json={"model": "tp", "prompt": prompt, "max_tokens": MAX_NEW,
                                                               "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(want)
        live.settle()
        assert live.leak_report() == []
    assert parallel.closed and [w.returncode for w in parallel.workers] == [0]
