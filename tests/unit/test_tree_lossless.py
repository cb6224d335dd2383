"""Losslessness of tree verification (infer.speculative.verifier), statistically.

Each case drafts 300,000 independent trees over a hand-built Markov "language" (p and q depend
on the depth and the parent token; tests/helpers/tree_harness.py), verifies them in one
round, and checks every emitted position: given the tokens before it, its empirical
distribution must be within total variation TV_BOUND of the target's, for every prefix seen
often enough that the estimate's expected sampling noise is below NOISE (the TOP_PREFIXES
most common prefixes; each position must have at least one). A verifier that always accepts
the first child fails the same check.

The tables favour a few tokens per context (a lead token most), so that prefixes of three
tokens are common enough to check; over 8 seeds per case the largest TV seen was 0.006, and
every case checked every position at these settings (vocabularies of 8, and of 32 for the
truncated case, whose distributions keep at most 6 tokens).
"""

from __future__ import annotations

import torch
from helpers.tree_harness import TV_BOUND, accept_first_child, conditional_tv, markov_tables, run_rounds

from infer.sampling import SamplingParams, logits_to_probs
from infer.speculative.tree import TreeShape

ROWS = 300_000


def _check(shape: TreeShape, p: torch.Tensor, q: torch.Tensor, seed: int, min_later: float = 0.005,
           **kw: object) -> dict[str, float]:
    packed, stats = run_rounds(shape, p, q, ROWS, seed, **kw)  # type: ignore[arg-type]
    tv, checked = conditional_tv(packed, p, shape.depth)
    assert all(checked), f"a position had no prefix common enough to check: {checked}"
    assert tv < TV_BOUND, f"emitted tokens deviate from the target: TV {tv:.4f} (checked {checked})"
    # children accepted after a sibling's rejection (from a residual), and bonus tokens, happen
    assert stats["later_child"] > min_later and stats["full"] > 0.1
    return stats


def _softmax_tables(v: int, depth: int, seed: int, lead: float,
                    draft_noise: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft = markov_tables(v, depth, seed, lead=lead, draft_noise=draft_noise)
    return torch.softmax(target, -1), torch.softmax(draft, -1)


def test_lossless_iid_children_sampled_from_q() -> None:
    shape = TreeShape.parse("3,2,2")
    p, q = _softmax_tables(8, shape.depth, seed=10, lead=2.0, draft_noise=0.6)
    _check(shape, p, q, seed=11)


def test_lossless_iid_children_with_many_duplicates() -> None:
    shape = TreeShape.parse("3,3,3")  # 39 nodes; a peaked q repeats siblings often
    p, q = _softmax_tables(8, shape.depth, seed=20, lead=2.0, draft_noise=0.6)
    stats = _check(shape, p, q, seed=21)
    assert stats["dup_root"] > 0.5


def test_lossless_deterministic_duplicate_children() -> None:
    shape = TreeShape.parse("4,2,1")  # children t1, t1, t2, t2: one-hot q, each token twice
    p, q = _softmax_tables(8, shape.depth, seed=30, lead=2.0, draft_noise=0.3)
    stats = _check(shape, p, q, seed=31, mode="dup")
    assert stats["dup_root"] == 1.0


def test_lossless_when_q_is_zero_where_p_is_not() -> None:
    shape, v = TreeShape.parse("3,2,2"), 8
    target, draft = markov_tables(v, shape.depth, seed=40, lead=2.0, draft_noise=0.6)
    keep = torch.rand(draft.shape, generator=torch.Generator().manual_seed(41)) > 0.4
    keep |= target == target.amax(-1, keepdim=True)  # q keeps p's likeliest token
    p, q = torch.softmax(target, -1), torch.softmax(draft.masked_fill(~keep, float("-inf")), -1)
    assert bool(((q == 0) & (p > 0.05)).any())
    _check(shape, p, q, seed=42, min_later=0.0)  # (the residual then lies mostly outside q's support)


def test_lossless_one_hot_q_deterministic_drafts() -> None:
    shape = TreeShape.parse("3,2,1")  # q's best distinct tokens: the n-gram kind of proposal
    p, q = _softmax_tables(8, shape.depth, seed=50, lead=2.0, draft_noise=0.3)
    stats = _check(shape, p, q, seed=51, mode="top")
    assert stats["dup_root"] == 0.0


def test_lossless_top_k_top_p_truncated_distributions() -> None:
    shape, v = TreeShape.parse("2,2,2"), 32
    target, draft = markov_tables(v, shape.depth, seed=60, lead=1.0, draft_noise=0.6)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits.reshape(-1, v), [params] * logits[..., 0].numel(), None).view(logits.shape)

    p, q = probs(target), probs(draft)
    assert int((p > 0).sum(-1).max()) <= 6 and bool(((p > 0) != (q > 0)).any())
    _check(shape, p, q, seed=61)


def test_lossless_with_absent_nodes() -> None:
    shape = TreeShape.parse("3,3,3")
    p, q = _softmax_tables(8, shape.depth, seed=70, lead=2.0, draft_noise=0.6)
    stats = _check(shape, p, q, seed=71, absent=0.25)
    assert stats["absent"] > 0.9
    p, q = _softmax_tables(8, 3, seed=72, lead=2.5, draft_noise=0.3)
    stats = _check(TreeShape.parse("3,2,2"), p, q, seed=73, mode="top", absent=0.2)
    assert stats["absent"] > 0.9


def test_lossless_siblings_drawn_without_replacement() -> None:
    shape = TreeShape.parse("3,2,2")  # each sibling from q renormalised over the tokens not yet taken
    p, q = _softmax_tables(8, shape.depth, seed=80, lead=2.0, draft_noise=0.6)
    stats = _check(shape, p, q, seed=81, mode="distinct")
    assert stats["dup_root"] == 0.0


def test_lossless_without_replacement_when_q_runs_out_of_tokens() -> None:
    shape, v = TreeShape.parse("3,2,1"), 8
    target, draft = markov_tables(v, shape.depth, seed=90, lead=2.0, draft_noise=0.6)
    second = draft.topk(2, dim=-1).values[..., -1:]  # q keeps 2 tokens a context: a third sibling finds none
    p, q = torch.softmax(target, -1), torch.softmax(draft.masked_fill(draft < second, float("-inf")), -1)
    stats = _check(shape, p, q, seed=91, mode="distinct")
    assert stats["absent"] == 1.0


def test_siblings_without_replacement_accept_more_than_iid_siblings_of_a_confident_wrong_draft() -> None:
    # the point of drawing without replacement: when the draft is sure of a token the target
    # rejects, an i.i.d. sibling mostly repeats it and is rejected again
    shape = TreeShape.parse("2,1,1")
    target, draft = markov_tables(32, shape.depth, seed=100, draft_noise=1.0)
    p, q = torch.softmax(target, -1), torch.softmax(draft * 1.5, -1)  # a noisy, sharpened draft
    accepted = {mode: float(run_rounds(shape, p, q, 50_000, seed=101, mode=mode)[0][:, shape.depth].float().mean())
                for mode in ("iid", "distinct")}
    assert accepted["distinct"] > accepted["iid"] + 0.2, accepted  # (1.51 against 0.99 at these seeds)


def test_negative_control_accepting_the_first_child_fails_the_same_check() -> None:
    shape = TreeShape.parse("3,2,2")
    p, q = _softmax_tables(8, shape.depth, seed=10, lead=2.0, draft_noise=0.6)
    packed, _ = run_rounds(shape, p, q, ROWS, seed=11, verifier=accept_first_child)
    tv, checked = conditional_tv(packed, p, shape.depth)
    assert all(checked) and tv > 5 * TV_BOUND
