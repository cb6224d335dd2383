"""Medusa heads end to end (CPU): greedy parity with plain decoding (chains and static trees,
batched, prefix caching with small chunks, preemption, the adaptive policy, FP8 heads),
greedy rows beside sampled ones, losslessness of sampling on a tiny vocabulary (total
variation against the exact joint distribution, with negative controls), refusals at
construction, and every request's hidden state given back (the suite's `make_llm` checks
`leak_report()`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.joint import force_accept_all, force_first_child, speculative_tv, tiny_model
from helpers.medusa_heads import write_medusa_head
from helpers.spec_e2e import DEPTH, ENGINE_CONFIGS, MAX_NEW, check_mixed_rows, run
from infer import LLM
from infer.engine.step_costs import weight_bytes

VOCAB, PROMPT, N, TV_LIMIT = 4, [2, 3, 2], 6000, 0.07  # as tests/integration/test_speculative_sampling.py
TREE = "3,2,1,1"  # depth DEPTH, 3 + 6 + 6 + 6 nodes


@pytest.fixture(scope="module")
def medusa(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"random": heads that almost never guess right; "copy": every head the target's own
    lm_head (each drafts the target's next token again, accepted where the target repeats)."""
    root = tmp_path_factory.mktemp("medusa")
    return {"random": write_medusa_head(root / "random", ckpt_a, DEPTH, 1),
            "copy": write_medusa_head(root / "copy", ckpt_a, DEPTH + 1, 2, copy_lm_head=True)}


def _llm(make_llm, ckpt: Path, head: Path, **options) -> LLM:
    kw = {"spec_length": DEPTH, **options}
    if "spec_tree" in kw:
        kw.pop("spec_length")
    return make_llm(ckpt, max_seq_len=256, use_speculative_decoding=True, speculative_method="medusa",
                    draft_model=str(head), **kw)


@pytest.mark.parametrize("tree", [None, TREE])
@pytest.mark.parametrize("config", ["paged-prefix-small-chunks", "paged-preempt"])
def test_greedy_parity(make_llm, ckpt_a, medusa, prompts, plain_outputs, config, tree) -> None:
    options = {} if tree is None else {"spec_tree": tree}
    llm = _llm(make_llm, ckpt_a, medusa["copy"], max_batch_size=8, **options, **ENGINE_CONFIGS[config])
    assert [o.outputs[0].token_ids for o in run(llm, prompts, batch=8)] == plain_outputs
    if config == "paged-preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    else:  # batch 1, each prompt twice: the second run starts after a cached prefix and still drafts
        drafts = llm.engine.runner.stats.drafts
        again = [o.outputs[0].token_ids for o in run(llm, prompts[:3] + prompts[:3], batch=1)]
        assert again == plain_outputs[:3] * 2
        assert llm.engine.runner.cache_pool.prefix_hit_rate > 0
        assert llm.engine.runner.stats.drafts - drafts >= 6 * (MAX_NEW // (DEPTH + 1) - 1)
    stats = llm.engine.runner.stats
    assert stats.accepted_tokens > 0  # (the copy heads' guesses: where the target repeats a token)
    assert stats.draft_tokens > (DEPTH * stats.drafts if tree else 0)  # (a tree: more nodes than a chain holds)


def test_random_heads_adaptive_and_mixed_sampling(make_llm, ckpt_a, medusa, prompts, plain_outputs) -> None:
    """Heads that are nearly always wrong under the adaptive policy (c from the weight bytes),
    greedy rows beside seeded sampled ones with penalties: greedy rows keep plain decoding's
    tokens, sampled rows their length."""
    llm = _llm(make_llm, ckpt_a, medusa["random"], max_batch_size=8, spec_policy="adaptive",
               **ENGINE_CONFIGS["contiguous"])
    check_mixed_rows(llm, prompts, plain_outputs)
    assert llm.engine.runner.stats.draft_tokens > 0
    spec, target = llm.engine.runner.speculation, llm.engine.models.target
    heads = spec.proposer.head  # c on a CPU: one head's bytes against the target's
    assert spec.policy.config.c == pytest.approx(weight_bytes(heads) / DEPTH / weight_bytes(target))


def test_fp8_heads_keep_parity(make_llm, ckpt_a, medusa, prompts, plain_outputs) -> None:
    llm = _llm(make_llm, ckpt_a, medusa["copy"], max_batch_size=4, draft_quantization="fp8", spec_tree="2,2")
    assert llm.engine.runner.speculation.proposer.head.lm_heads[0].quantization == "fp8"
    assert [o.outputs[0].token_ids for o in run(llm, prompts[:4], batch=4)] == plain_outputs[:4]


def test_refused_at_construction(make_llm, ckpt_a, medusa, monkeypatch) -> None:
    """Too deep a round for the heads, and heads without a directory, are refused before any
    weight is read."""
    import infer.engine.loading as loading
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: pytest.fail("target weights read before the check"))
    with pytest.raises(ValueError, match=f"have {DEPTH} heads, one per draft depth, but spec_length is {DEPTH + 1}"):
        _llm(make_llm, ckpt_a, medusa["random"], spec_length=DEPTH + 1)
    with pytest.raises(ValueError, match="spec_length is 5: set spec_length"):
        _llm(make_llm, ckpt_a, medusa["random"], spec_tree="2,1,1,1,1")
    with pytest.raises(ValueError, match="speculative_method='medusa' requires draft_model"):
        LLM(str(ckpt_a), device="cpu", speculative_method="medusa")
    with pytest.raises(ValueError, match="runs on one GPU"):
        LLM(str(ckpt_a), device="cpu", speculative_method="medusa", draft_model=str(medusa["random"]),
            tensor_parallel_size=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = tiny_model(tmp_path_factory.mktemp("t"), VOCAB, seed=1)
    return target, write_medusa_head(tmp_path_factory.mktemp("h"), target, 3, 1, std=0.5)


def _tv(make_llm, tiny, n: int = N, **options) -> tuple[float, LLM]:
    target, head = tiny
    return speculative_tv(make_llm, target, PROMPT, VOCAB, n, speculative_method="medusa", draft_model=str(head),
                          **{"max_batch_size": 64, "spec_length": 3, **options})


def test_sampling_lossless(make_llm, tiny) -> None:
    """One-hot drafts (the heads' argmax): the target's distribution, drafts accepted and rejected."""
    tv, llm = _tv(make_llm, tiny)
    stats = llm.engine.runner.stats
    assert tv < TV_LIMIT
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_negative_control_accept_all_fails(make_llm, tiny, monkeypatch) -> None:
    force_accept_all(monkeypatch)
    tv, _ = _tv(make_llm, tiny)
    assert tv > TV_LIMIT


# the first three tokens: the prefill's, then one round of the depth-2 tree (4 tokens asked: the
# length guard leaves it both levels)
TREE_TV = dict(spec_tree="3,2", spec_length=2, max_batch_size=256)


def test_tree_sampling_lossless(make_llm, tiny) -> None:
    """Siblings are a head's distinct top tokens, each a one-hot q: the tree verifier tries
    them in turn against the residual and keeps the target's distribution."""
    tv, llm = _tv(make_llm, tiny, **TREE_TV)
    stats = llm.engine.runner.stats
    assert tv < TV_LIMIT
    assert 0 < stats.accepted_tokens < sum(stats.drafted_per_position)


def test_tree_negative_control_first_child_accepted_fails(make_llm, tiny, monkeypatch) -> None:
    force_first_child(monkeypatch)
    tv, _ = _tv(make_llm, tiny, n=N // 4, **TREE_TV)
    assert tv > TV_LIMIT
