"""Dynamic token trees (spec_tree="dynamic:N[:B]"): the per-row tree types, the verifier over
a `TreeFrame` (equal to the static verifier on static shapes), the selection's guarantees,
losslessness over the Markov harness with a negative control, and the configuration.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.dynamic_harness import dynamic_round, own_path_scores
from helpers.tree_harness import TV_BOUND, conditional_tv, markov_tables

from infer import EngineConfig
from infer.speculative.dynamic_select import NEG_INF, best_slots, kept_tree, slot_scores
from infer.engine.verification import block_row
from infer.speculative.node_tree import DynamicShape, NodeTree, frame_of_trees
from infer.speculative.tree import Draft, TreeShape, tree_attention_mask
from infer.speculative.verifier import verify_tree_greedy, verify_tree_nodes

ROWS = 200_000


def _inputs(shape: TreeShape, b: int, v: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n = shape.num_nodes
    tokens = torch.randint(0, v, (b, n), generator=g)
    q = torch.softmax(torch.randn(b, n, v, generator=g), -1)
    p = torch.softmax(torch.randn(b, n + 1, v, generator=g) * 2, -1)
    tokens[:, 0] = p[:, 0].argmax(-1)  # (some acceptances)
    valid = torch.rand(b, n, generator=g) > 0.2
    u = torch.rand(b, shape.num_uniforms, generator=g, dtype=torch.float64)
    return tokens, q, p, valid, u


@pytest.mark.parametrize("mode", ["draft_probs", "one_hot", "greedy"])
def test_frame_of_per_row_trees_verifies_as_the_static_shape(mode):
    shape = TreeShape.parse("3,2,1")
    tokens, q, p, valid, u = _inputs(shape, 64, 6, seed=1)
    trees = [NodeTree(shape.parents, shape.branching)] * 64
    frame = frame_of_trees(trees, shape.num_nodes, shape.branching, torch.device("cpu"))
    if mode == "greedy":
        static, dynamic = (verify_tree_greedy(s, p, tokens, valid) for s in (shape, frame))
    else:
        probs = q if mode == "draft_probs" else None
        static, dynamic = (verify_tree_nodes(s, tokens, probs, p, u, valid) for s in (shape, frame))
    assert torch.equal(static[0], dynamic[0]) and torch.equal(static[1], dynamic[1])
    assert int(static[0][:, shape.depth].sum()) > 0  # something was accepted


def test_rows_with_their_own_trees_verify_as_each_alone():
    widths = (2, 2)
    trees = [NodeTree((-1, -1, 0, 0), widths), NodeTree((-1, 0, 0), widths), NodeTree((-1, -1, 1), widths)]
    n = 4
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 5, (3, n), generator=g)
    valid = torch.tensor([[True] * 4, [True] * 3 + [False], [True] * 3 + [False]])
    p = torch.softmax(torch.randn(3, n + 1, 5, generator=g), -1)
    q = torch.softmax(torch.randn(3, n, 5, generator=g), -1)
    u = torch.rand(3, 5, generator=g, dtype=torch.float64)
    frame = frame_of_trees(trees, n, widths, torch.device("cpu"))
    packed, nodes = verify_tree_nodes(frame, tokens, q, p, u, valid)
    for b, tree in enumerate(trees):
        one = frame_of_trees([tree], n, widths, torch.device("cpu"))
        alone = verify_tree_nodes(one, tokens[b:b + 1], q[b:b + 1], p[b:b + 1], u[b:b + 1], valid[b:b + 1])
        assert torch.equal(packed[b:b + 1], alone[0]) and torch.equal(nodes[b:b + 1], alone[1])
        assert all(i < tree.num_nodes for i in nodes[b].tolist() if i >= 0)


def test_a_dynamic_trees_block_row_masks_ancestors_per_row():
    shape = TreeShape.parse("2,2")
    tree, n = NodeTree(shape.parents, shape.branching), shape.num_nodes
    request = SimpleNamespace(slot=3, num_computed_tokens=7, last_token_id=9)
    row = block_row(request, Draft(tree, tuple(range(1, n + 1)), (True,) * n))
    assert (row.slot, row.start, list(row.ids), row.logits) == (3, 7, [9, *range(1, n + 1)], n + 1)
    assert row.tree is not None and row.tree.width == n + 1
    mask = [[bool(bits >> c & 1) for c in range(n + 1)] for bits in row.tree.bits]
    assert mask == tree_attention_mask(shape).tolist()
    assert list(row.tree.rope_offsets) == [0, *shape.depths]
    chain = block_row(request, Draft(NodeTree((-1, 0, 1), (2, 2, 2)), (5, 6, 7), (True,) * 3))
    assert chain.tree is not None and chain.tree.bits[3] == 0b1111  # node 2 sees g, nodes 0, 1, itself
    assert list(chain.tree.rope_offsets) == [0, 1, 2, 3]
    cut = block_row(request, Draft(NodeTree((-1, 0, 1), (2, 2, 2)), (5, 6, 0), (True, True, False)))
    assert cut.tree is not None and list(cut.tree.bits) == [0b1, 0b11, 0b111]  # no row past the last present node


@pytest.mark.parametrize("parents, widths, message", [
    ((-1, 1), (2, 2), "earlier node"),
    ((-1, 0, -1), (2, 2), "breadth-first"),
    ((-1, -1, -1), (2, 2), "children"),
    ((-1, 0, 1), (2, 2), "levels"),
])
def test_node_tree_refuses_what_is_not_a_breadth_first_tree(parents, widths, message):
    with pytest.raises(ValueError, match=message):
        NodeTree(parents, widths)


def test_slot_scores_are_greedy_path_probabilities_and_bounded_by_the_parent():
    base = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    top = torch.tensor([[0, 1], [1, 2]])  # greedy children: rank order
    drawn = torch.ones(2, 2, dtype=torch.bool)
    scores, paths = slot_scores(base, top, drawn, torch.tensor([1.0, 0.5], dtype=torch.float64),
                                torch.tensor([float("inf"), 0.25], dtype=torch.float64))
    assert torch.allclose(scores[0], paths[0])
    assert paths[0].tolist() == pytest.approx([0.5, 0.3])
    assert scores[1].tolist() == pytest.approx([0.25, 0.15])  # min(0.5 * 0.6, 0.25), then 0.5 * 0.3
    # a sampled draw's slot is scored by the best token left, not by its own token
    sampled, _ = slot_scores(base, torch.tensor([[2, 0]]), drawn[:1], torch.ones(1, dtype=torch.float64),
                             torch.full((1,), float("inf"), dtype=torch.float64))
    assert sampled[0].tolist() == pytest.approx([0.5, 0.5])


def test_best_slots_keep_ancestors_and_elder_siblings_first():
    scores = torch.tensor([[0.5, 0.5, 0.2, NEG_INF, 0.5, 0.1]], dtype=torch.float64)
    pick, ok = best_slots(scores, 4)
    assert pick.tolist() == [[0, 1, 2, 4]] and ok.all()  # ties go to the earlier slot; index order
    pick, ok = best_slots(scores, 6)
    assert ok.tolist() == [[True] * 5 + [False]] and pick[0, -1] == 3
    assert kept_tree([0, 1, 4], [-1, -1, 0, 0, 1, 2]) == [-1, -1, 1]
    with pytest.raises(AssertionError, match="without its parent"):
        kept_tree([0, 5], [-1, -1, 0, 0, 1, 2])


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft = markov_tables(8, 3, seed, lead=2.0, draft_noise=0.6)
    return torch.softmax(target, -1), torch.softmax(draft, -1)


@pytest.mark.parametrize("sampled", [True, False])
def test_lossless_dynamic_trees_over_a_markov_language(sampled):
    p, q = _tables(20)
    packed = dynamic_round(p, q, ROWS, nodes=4, branch=2, depth=3, gen=torch.Generator().manual_seed(21),
                           sampled=sampled)
    tv, checked = conditional_tv(packed, p, 3)
    assert all(checked) and tv < TV_BOUND, (tv, checked)
    assert float(packed[:, 3].float().mean()) > 1.5  # deep paths are accepted


def test_negative_control_ranking_sampled_nodes_by_their_own_path_probability_fails():
    p, q = _tables(20)
    packed = dynamic_round(p, q, ROWS, nodes=4, branch=2, depth=3, gen=torch.Generator().manual_seed(21),
                           scorer=own_path_scores)
    tv, checked = conditional_tv(packed, p, 3)
    assert all(checked) and tv > 5 * TV_BOUND


def _config(**kw):
    base = dict(use_speculative_decoding=True, model="m", draft_model="d")
    return EngineConfig(**{**base, **kw})


def test_config_parses_and_normalises_dynamic_trees():
    config = _config(spec_tree=" dynamic:16 ")
    assert config.spec_tree == "dynamic:16:4" and config.spec_length == 5
    assert _config(spec_tree="dynamic:2", spec_length=3).spec_tree == "dynamic:2:2"
    assert DynamicShape.parse("dynamic:10:3", 4).num_uniforms == 13


@pytest.mark.parametrize("kw, message", [
    (dict(spec_tree="dynamic:"), "is written"),
    (dict(spec_tree="dynamic:8:x"), "is written"),
    (dict(spec_tree="dynamic:0"), "nodes must be"),
    (dict(spec_tree="dynamic:500"), "nodes must be"),
    (dict(spec_tree="dynamic:8:0"), "branch must be"),
    (dict(spec_tree="dynamic:8", speculative_method="ngram"), "draft model"),
    (dict(spec_tree="dynamic:8", spec_policy="adaptive"), "spec_policy='fixed'"),
    (dict(spec_tree="dynamic:8", tensor_parallel_size=2), "one GPU"),
    (dict(spec_tree="dynamic:8", use_speculative_decoding=False), "use_speculative_decoding=True"),
])
def test_config_refuses_bad_dynamic_trees(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)
