"""Tree speculation under tensor parallelism on the CPU (gloo, 2 processes): the same tokens as one process.

The workers run each tree chunk's forward (its block mask and rotary positions) on their
shard and repeat the driver's compaction of the accepted path's K/V rows; rank 0 alone runs
the tree verifier. Trees of two shapes, drafted by a model (whole on the driver, or sharded
like the target) and by n-grams, greedy and seeded sampled rows, in float32, must give the
tokens an engine of one rank gives; every engine ends with no leak on any rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import mixed_prompts
from infer import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts(tp_ckpt: Path) -> list[list[int]]:
    return mixed_prompts(tp_ckpt, seed=23)


def _params(n: int, sampled: bool) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8 if sampled and i % 2 == 0 else 0.0, seed=70 + i,
                           max_tokens=MAX_NEW - (i % 3), ignore_eos=True) for i in range(n)]


def _run(model: Path, prompts: list[list[int]], params: list[SamplingParams], **kwargs: Any) -> tuple[
        list[list[int]], Any, list[int | None]]:
    """(tokens per prompt, the runner's speculation stats, the workers' exit codes)."""
    with LLM(str(model), device="cpu", max_seq_len=256, dtype="float32", block_size=4, max_num_batched_tokens=16,
             use_speculative_decoding=True, **kwargs) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert llm.engine.leak_report() == []  # every rank's pools, the workers' included
        stats = llm.engine.runner.stats
        parallel = llm.engine.parallel
        workers = parallel.workers if parallel is not None else ()
    return out, stats, [w.returncode for w in workers]


@pytest.mark.parametrize(("tree", "method", "placement", "sampled"), [
    ("2,2", "draft_model", "driver", False),
    ("3,1", "draft_model", "sharded", True),
    ("2,2", "ngram", "driver", True),
    ("3,1", "ngram", "driver", False),
])
def test_tree_speculation_tp2_gives_the_tokens_of_tp1(tp_ckpt: Path, tp_draft: Path, prompts: list[list[int]],
                                                      tree: str, method: str, placement: str, sampled: bool) -> None:
    """Driver: an unrelated draft (most nodes rejected). Sharded: the target drafting for
    itself (whole paths accepted: the compaction moves rows on every rank)."""
    kw: dict[str, Any] = dict(spec_tree=tree, speculative_method=method)
    if method == "draft_model":
        kw["draft_model"] = str(tp_draft if placement == "driver" else tp_ckpt)
    params = _params(len(prompts), sampled)
    one, stats1, _ = _run(tp_ckpt, prompts, params, **kw)
    two, stats2, codes = _run(tp_ckpt, prompts, params, tensor_parallel_size=2, tensor_parallel_draft=placement,
                              **kw)
    assert two == one
    assert all(len(t) == MAX_NEW - (i % 3) for i, t in enumerate(two))
    assert codes == [0]  # closed: the worker left cleanly
    assert stats2.drafts > 0 and (stats2.drafts, stats2.accepted_tokens) == (stats1.drafts, stats1.accepted_tokens)
    if placement == "sharded":  # nearly every round accepts a path of the tree's full depth
        assert sum(stats2.accepted_per_position) > 0.9 * sum(stats2.drafted_per_position)
