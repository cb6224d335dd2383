"""The token-level intersection of two vocabularies (speculative/vocab_map.py) and how a draft
of another vocabulary reads requests and reports drafts (speculative/foreign_draft.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infer.speculative.foreign_draft import DraftTokens, DraftView, ForeignDraftProposer
from infer.speculative.tree import Draft, TreeShape, chain_shape
from infer.speculative.vocab_map import VocabMap, greedy_pieces, probs_to_target

# target: 0 <s>, 1 "a", 2 "b", 3 "ab", 4 "abc", 5 <0x61>-style duplicate of "a", 6 <eot> (special)
TARGET = ["<s>", b"a", b"b", b"ab", b"abc", b"a", "<eot>"]
# draft: 0 "b", 1 "x", 2 "a", 3 "c", 4 <s>, 5 "bc", 6 "b" again
DRAFT = [b"b", b"x", b"a", b"c", "<s>", b"bc", b"b"]


@pytest.fixture
def vmap() -> VocabMap:
    return VocabMap.intersect(TARGET, 8, DRAFT, 7)  # (the target's id 7: a padding row)


def test_shared_tokens_map_canonical_ids_both_ways(vmap: VocabMap) -> None:
    # shared keys: <s>, "a", "b"; duplicates map to the lowest id of their key
    assert vmap.draft_to_target == (2, -1, 1, -1, 0, -1, -1)
    assert vmap.target_to_draft == (4, 2, 0, -1, -1, 2, -1, -1)
    assert vmap.shared == 3 and vmap.sizes == (6, 6) and vmap.fraction == 0.5
    assert vmap.describe().startswith("3 shared tokens, 50.0% of the smaller vocabulary (6 tokens")
    assert vmap.draft_allowed().tolist() == [True, False, True, False, True, False, False]
    assert vmap.probs_source().tolist() == [4, 2, 0, -1, -1, -1, -1, -1]


def test_target_tokens_expand_into_draft_ids(vmap: VocabMap) -> None:
    assert vmap.expand(1) == (2,) and vmap.expand(5) == (2,)  # shared (a duplicate too)
    assert vmap.expand(3) == (2, 0)  # "ab" re-tokenized: "a" "b"
    assert vmap.expand(4) == (2, 5)  # "abc": the longest piece first after "a": "bc"
    assert vmap.expand(6) == () and vmap.expand(7) == ()  # a special the draft lacks; a padding row
    assert vmap.expansions[3] == (2, 0)  # (kept)


def test_greedy_pieces_take_the_longest_piece_and_skip_unknown_bytes() -> None:
    pieces = {b"a": 0, b"ab": 1, b"abc": 2, b"c": 3}
    assert greedy_pieces(b"abcab", pieces, 3) == (2, 1)
    assert greedy_pieces(b"zaz", pieces, 3) == (0,)
    assert greedy_pieces(b"", pieces, 3) == ()


def test_q_moves_to_the_target_columns(vmap: VocabMap) -> None:
    q = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2, 0.0, 0.0]], dtype=torch.float64)
    source = vmap.probs_source()
    out = probs_to_target(q, source.clamp(min=0), source < 0)
    assert out.tolist() == [[0.2, 0.3, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert out.sum().item() == pytest.approx(1.0)


def _proposer(vmap: VocabMap) -> ForeignDraftProposer:
    inner = SimpleNamespace(device=torch.device("cpu"))
    return ForeignDraftProposer(inner, vmap)  # type: ignore[arg-type]


def test_drafts_map_to_target_ids_and_unshared_nodes_fall_with_their_subtrees(vmap: VocabMap) -> None:
    proposer = _proposer(vmap)
    chain = proposer.to_target(Draft.chain(chain_shape(3), [2, 0, 4], torch.full((3, 7), 1 / 7)))
    assert chain.token_ids == (1, 2, 0) and chain.valid == (True, True, True)
    assert chain.probs is not None and chain.probs.shape == (3, 8) and chain.probs[0, 1] == pytest.approx(1 / 7)
    shape = TreeShape.parse("2,1")  # nodes 0, 1 under the root; 2 under 0, 3 under 1
    tree = proposer.to_target(Draft(shape, (1, 2, 0, 4), (True, True, True, True)))
    assert tree.token_ids == (0, 1, 0, 0) and tree.valid == (False, True, False, True)
    assert tree.probs is None


def test_a_request_reads_as_the_draft_ids_of_its_tokens(vmap: VocabMap) -> None:
    request = SimpleNamespace(request_id="r", prompt_token_ids=[0, 3, 6], output_token_ids=[1, 4], pending_tokens=0,
                              num_computed_tokens=3, sampling_params=None, slot=5, generator=None, fault=None,
                              prefill_target=4)
    request.num_tokens = 5
    request.token_slice = lambda lo, hi=None: [0, 3, 6, 1, 4][lo:hi]
    tokens = DraftTokens()
    tokens.sync(vmap, request)
    assert tokens.ids == [4, 2, 0, 2, 2, 5] and tokens.ends == [1, 3, 3, 4, 6]
    view = DraftView(request, tokens)
    # the target's first n + 1 = 4 tokens (g = "a") are the draft's first 4: its g is index 3
    assert view.num_computed_tokens == 3 and view.token_slice(1) == [2, 0, 2]
    assert view.prompt_token_ids == [4, 2, 0] and view.prefill_target == 4 and view.grammar is None
    view.fault = "bad"
    assert request.fault == "bad"
    request.num_computed_tokens = 1  # g = "ab": the last of its two draft ids is pending
    assert DraftView(request, tokens).num_computed_tokens == 2
    request.num_computed_tokens = 5  # g not known yet
    assert DraftView(request, tokens).num_computed_tokens == -1


def test_a_token_in_flight_is_reserved_at_the_longest_expansion(vmap: VocabMap) -> None:
    # the scheduler reserves a round before the host knows a token in flight (a prefill's
    # sampled token under overlap): it may expand into as many draft ids as any target token
    assert vmap.longest_expansion() == 2  # "ab", "abc": two draft ids each
    taken: list[int] = []
    inner = SimpleNamespace(device=torch.device("cpu"), pool=SimpleNamespace(max_seq_len=64),
                            ensure_capacity=lambda request, total, take: taken.append(total) or True,
                            release=lambda request: None)
    proposer = ForeignDraftProposer(inner, vmap)  # type: ignore[arg-type]
    ids = [0, 3, 1]  # <s> "ab" "a": draft ids 4 | 2 0 | 2
    request = SimpleNamespace(request_id="r", prompt_token_ids=ids[:2], output_token_ids=[1], pending_tokens=1,
                              num_computed_tokens=2, sampling_params=None, slot=0, generator=None, fault=None,
                              prefill_target=2)
    request.num_tokens = 3
    request.token_slice = lambda lo, hi=None: ids[lo:hi]
    # target positions < 5: tokens 0, 1 known (3 draft ids), token 2 in flight (at most 2),
    # tokens 3, 4 the round's own (one each)
    assert proposer.ensure_capacity(request, 5)  # type: ignore[arg-type]
    assert taken == [3 + 2 + 2]
    request.pending_tokens = 0  # known now: "a" is one draft id
    assert proposer.ensure_capacity(request, 5)  # type: ignore[arg-type]
    assert taken[-1] == 3 + 1 + 2
    proposer.release(request)  # type: ignore[arg-type]
    assert proposer.tokens == {}
