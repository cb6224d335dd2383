"""Speculation on a KV pool that only just holds a request (CPU, tiny checkpoints).

Admission checks prompt + max_tokens against the pool, but a round writes its whole block
(K + 1 positions, a tree's nodes): near its end a request alone in such a pool used to
preempt itself, recompute and preempt again forever. Now the scheduler gives a request
with no one left to preempt a smaller round (down to a plain step). Every method and shape
finishes within a step cap, with plain decoding's greedy tokens and nothing leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.eagle_heads import write_head
from infer import LLM, SamplingParams

PROMPT = [5, 6] * 10  # 20 tokens; the model then repeats a token, which n-gram tables draft
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
STEP_CAP = 200  # plain decoding needs 13 steps; a livelock never ends

SHAPES = {
    "chain": dict(spec_length=3),
    "chain-long": dict(spec_length=8),
    "tree": dict(spec_tree="2,2,1"),
    "dynamic": dict(spec_tree="dynamic:6:2", spec_length=3),
}


@pytest.fixture(scope="module")
def eagle3_head(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head") / "eagle3", ckpt_a, "eagle3", draft_vocab=120,
                      aux_layers=[0, 1, 1])


def finish(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens, driving the engine step by step; fails past STEP_CAP steps."""
    engine = llm.engine
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(STEP_CAP):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), (f"not finished after {STEP_CAP} steps "
                                         f"({engine.scheduler.num_preemptions} preemptions)")
    return [list(r.output_token_ids) for r in requests]


def plain(ckpt: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cpu", max_seq_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle3"])
def test_a_request_that_only_just_fits_finishes(make_llm, ckpt_a, random_draft, eagle3_head, method, shape,
                                                block_size):
    if method != "draft_model" and shape == "dynamic":
        pytest.skip("dynamic trees are drafted by a draft model only")
    draft = {"draft_model": str(random_draft), "eagle3": str(eagle3_head)}.get(method)
    tokens = len(PROMPT) + MAX_TOKENS
    llm = make_llm(ckpt_a, block_size=block_size, num_blocks=tokens // block_size, max_seq_len=256,
                   enable_prefix_caching=False, use_speculative_decoding=True, speculative_method=method,
                   draft_model=draft, **SHAPES[shape])
    assert llm.engine.kv_capacity_tokens() == tokens  # the request fills the pool exactly
    assert finish(llm, [PROMPT], GREEDY) == plain(ckpt_a, [PROMPT])
    assert llm.engine.runner.stats.rounds > 0  # it speculated while the pool allowed


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_several_requests_on_a_tight_pool_all_finish(make_llm, ckpt_a, shape):
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:17]]
    llm = make_llm(ckpt_a, block_size=2, num_blocks=(len(PROMPT) + MAX_TOKENS) // 2, max_seq_len=256,
                   use_speculative_decoding=True, draft_model=str(ckpt_a), **SHAPES[shape])
    assert finish(llm, prompts, GREEDY) == plain(ckpt_a, prompts)
    assert llm.engine.scheduler.num_preemptions > 0  # the pool holds one of them at a time


@pytest.fixture(scope="module")
def near_draft(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.fuzz_models import FuzzModels
    return FuzzModels.build(tmp_path_factory.mktemp("near"), target=ckpt_a).draft("near")


def test_seeded_samples_repeat_through_preemption_and_prefix_hits(make_llm, ckpt_a, near_draft):
    # n = 3 choices of one prompt on a pool holding about two of them: the first generate
    # preempts one in its prefill, the second finds the prompt in the prefix cache and runs
    # two at once. The draft pool shares no prefix, so a request used to find it full at its
    # first round and draft nothing then: a plain step where the other generate verified a
    # round, which draws other uniforms, so its seeded sample changed. Now a draft pool
    # without room is memory short like the target's (the scheduler preempts), and the
    # second generate repeats the first.
    prompt = [0, 200, 192, 370, 327, 210, 381, 227, 253, 264, 47, 6, 291, 48, 6, 282, 94, 325, 146, 12, 244, 81, 52,
              207, 126]
    params = SamplingParams(repetition_penalty=1.3, max_tokens=10, ignore_eos=True, seed=1313722422, n=3)
    llm = make_llm(ckpt_a, use_speculative_decoding=True, draft_model=str(near_draft), spec_length=3,
                   num_blocks=4, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=True)
    runs = [[c.token_ids for c in llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs]
            for _ in range(2)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.stats.rounds > 0
    assert runs[0] == runs[1]


def test_a_round_drafted_ahead_survives_rows_leaving_the_batch(make_llm, tmp_path_factory):
    # four greedy copies of a prompt on a pool that holds fewer at once, each drafting its
    # next round ahead with a one-step EAGLE-3 head: a request preempted (or stepping
    # plainly) since its round was drafted leaves rows in that round past the batch's; the
    # verification takes the round's first rows (it placed all of them, and failed)
    from helpers.fuzz_models import FuzzModels
    models = FuzzModels.build(tmp_path_factory.mktemp("fuzz"))
    prompt = [0, 5, 188, 327] + [5, 188, 327] * 7
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, n=4)
    llm = make_llm(models.target, use_speculative_decoding=True, speculative_method="eagle3",
                   draft_model=str(models.draft("eagle3")), spec_length=1, block_size=2, num_blocks=29,
                   max_seq_len=256)
    outs = [c.token_ids for c in llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs]
    assert outs == [tokens[:9] for tokens in plain(models.target, [prompt] * 4)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.runner.stats.rounds > 0
    assert llm.engine.leak_report() == []
