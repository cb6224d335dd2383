"""An EAGLE head over a prefix-cache hit drafts as on a cold cache (issue 60).

The target computes no features for a cached prefix; the head's own prompt blocks are
cached beside the target's and restored at a hit (speculative/eagle.py). So a seeded
sampled request gives the same tokens run again over its cached prompt, and over a prefix
an earlier prompt left (a partial hit, one cut where the head's block needs the token after
it) it gives what an engine without prefix caching gives; greedy rows stay plain decoding's
and both pools give every block back. Chains and a static tree, EAGLE and EAGLE-3 heads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.spec_e2e import GREEDY, plain_greedy
from infer import LLM, SamplingParams

SEEDS = (337701082, 5, 77, 2024)  # (the first: the issue's)
SHAPES = {"chain": dict(spec_length=1), "chain-3": dict(spec_length=3), "tree": dict(spec_tree="2,1", spec_length=2)}


def _llm(make_llm, ckpt: Path, head: Path, method: str, shape: str, **options) -> LLM:
    return make_llm(ckpt, max_seq_len=128, use_speculative_decoding=True, speculative_method=method,
                    draft_model=str(head), **SHAPES[shape], **options)


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=2.0, max_tokens=8, ignore_eos=True, seed=seed)


def _one(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """The prompt's tokens alone on the engine, and the prompt tokens its target took from the cache."""
    pool = llm.engine.runner.cache_pool
    before = pool.prefix_hit_tokens
    tokens = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0].token_ids
    return tokens, pool.prefix_hit_tokens - before


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_seeded_rows_repeat_over_their_cached_prompts(make_llm, ckpt_a, heads, prompts, method, shape) -> None:
    """Each prompt twice on one engine of block size 1: the second run's target computes only
    the last prompt token, its head's entries of the rest are restored; the tokens repeat."""
    llm = _llm(make_llm, ckpt_a, heads[method], method, shape, block_size=1)
    cases = list(zip([[0, 69], *prompts[:3]], SEEDS, strict=True))
    first = [_one(llm, p, _sampled(seed))[0] for p, seed in cases]
    again = [_one(llm, p, _sampled(seed)) for p, seed in cases]
    assert [tokens for tokens, _ in again] == first
    assert [hit for _, hit in again] == [len(p) - 1 for p, _ in cases]
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("shape", ["chain-3", "tree"])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_partial_hits_sample_as_without_prefix_caching(make_llm, ckpt_a, heads, method, shape) -> None:
    """Prompts sharing a prefix with an earlier one, on a pool of 4-token blocks: their seeded
    tokens are those of an engine without prefix caching. A prompt leaving the earlier one at
    a block's end takes one block less than the target holds (the head's block keys the token
    after it); an unrelated prompt evicting cached blocks of both pools changes nothing."""
    base = [0, *range(40, 53)]  # 14 tokens: blocks 0..2 cached after it
    jobs = [(base, 0, 0),
            (base[:10] + [7, 8, 9, 10], 1, 8),  # shares blocks 0, 1 and the token after them
            (base[:8] + [200, 201, 202], 2, 4),  # leaves at block 1's end: the head restores block 0
            ([0, *range(100, 150)], 3, None),  # 51 tokens: evicts cached blocks of both pools
            (base[:10] + [7, 8, 9, 10], 1, None)]
    cached = _llm(make_llm, ckpt_a, heads[method], method, shape, block_size=4, num_blocks=16)
    cold = _llm(make_llm, ckpt_a, heads[method], method, shape, block_size=4, num_blocks=16,
                enable_prefix_caching=False)
    for i, (prompt, seed, hit) in enumerate(jobs):
        tokens, taken = _one(cached, prompt, _sampled(SEEDS[seed]))
        assert tokens == _one(cold, prompt, _sampled(SEEDS[seed]))[0], i
        assert hit is None or taken == hit, i
        if i == 0:  # a greedy row over all three cached blocks
            greedy = base + [5, 6]
            assert _one(cached, greedy, GREEDY) == (plain_greedy(ckpt_a, [greedy])[0], 12)
    assert cached.engine.runner.stats.draft_tokens > 0
    assert cached.engine.leak_report() == [] and cold.engine.leak_report() == []
