"""Tree proposers' pure parts: a draft model's children per node (top-b at T=0, draws from q
without replacement when sampling, mixed rows), n-gram trees cut at a depth limit, and the storage
guard of the tree runner."""

from __future__ import annotations

import pytest
import torch

from infer.engine.request import Request
from infer.engine.speculation import fit_depth
from infer.sampling import SamplingParams
from infer.speculative.draft_model import fed_positions
from infer.speculative.tree_expand import children
from infer.speculative.ngram import NgramProposer
from infer.speculative.tree import Draft, TreeShape

SHAPE = TreeShape((3, 2, 1, 1))  # level_starts 0, 3, 9, 15, 21


def test_greedy_children_are_the_top_tokens_in_rank_order():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5], [5.0, 0.0, 1.0, 4.0, 0.5]])
    kids, q, drawn = children(logits, [SamplingParams(temperature=0)] * 2, None, 3, None)
    assert kids.tolist() == [1, 4, 2, 0, 3, 2] and q is None and drawn is None


def test_sampled_children_are_distinct_each_drawn_from_the_rest_of_q():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0)]
    kids, q, drawn = children(logits, params, None, 3, torch.tensor([0.1, 0.1, 0.9], dtype=torch.float64))
    assert kids.tolist() == [0, 1, 3]  # the same uniform twice still gives two tokens
    assert q is not None and drawn is not None and drawn.tolist() == [True] * 3
    expected = torch.tensor([[0.25] * 4, [0.0] + [1 / 3] * 3, [0.0, 0.0, 0.5, 0.5]])
    assert torch.allclose(q, expected)  # each child's own q: the rest of q after its elder siblings


def test_mixed_rows_and_penalties():
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=4.0), SamplingParams(temperature=1.0, top_k=1)]
    kids, q, drawn = children(logits, params, [[1], [1]], 2,
                              torch.tensor([0.3, 0.7, 0.3, 0.7], dtype=torch.float64))
    # row 0 (greedy): token 1 penalised below token 0; row 1: top-k 1 leaves token 1 only, so
    # its second child finds no mass left and is absent
    assert kids.tolist() == [0, 1, 1, 0] and drawn is not None and drawn.tolist() == [True, True, True, False]
    assert q is not None and q[2:].tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_fed_positions_and_storage_guard():
    assert [fed_positions(SHAPE, k) for k in (1, 2, 3, 4)] == [1, 4, 10, 16]
    # depth k writes positions n .. n + level_starts[k]; max_seq_len 40
    assert fit_depth(SHAPE, 4, 18, 40) == 4  # 18 + 21 = 39 fits
    assert fit_depth(SHAPE, 4, 19, 40) == 3  # 19 + 21 = 40 does not; 19 + 15 does
    assert fit_depth(SHAPE, 2, 19, 40) == 2 and fit_depth(SHAPE, 4, 39, 40) == 0


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams())


@pytest.mark.parametrize("method", ["ngram", "prompt_lookup"])
def test_ngram_trees_respect_depth_limits(method):
    from infer.speculative.ngram import NgramConfig
    proposer = NgramProposer(NgramConfig(method=method))
    history = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]
    reqs = [_request("a", history), _request("b", history), _request("c", history)]
    full, cut, none = proposer.propose(reqs, SHAPE, [4, 1, 0])
    assert full.depth == 4 and full.token_ids[0] == 3  # after "1 2": 3 (twice), ...
    assert cut.depth == 1 and cut.token_ids[:3] == full.token_ids[:3]
    assert cut.num_proposed == full.valid[:3].count(True) < full.num_proposed
    assert none == Draft.empty(SHAPE) and proposer.table("c") is None  # (no lookup for depth 0)
    with pytest.raises(ValueError, match="one depth per request"):
        proposer.propose(reqs, SHAPE, [1])
