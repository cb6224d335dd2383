"""Tree speculation (issue #37): TreeShape, tree masks, the tree verifier's exact rule on
hand-built cases, its equivalence with the chain verifier and the greedy walk, and n-gram tree
proposals. The statistical losslessness tests are in test_tree_lossless.py."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infer.engine.request import Request
from infer.sampling import SamplingParams, logits_to_probs
from infer.speculative.ngram import NgramConfig, NgramProposer, NgramTable, PromptLookupTable
from infer.speculative.verifier import unpack_rows, verify_logits, verify_tensors
from infer.speculative.tree import (
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    Draft,
    TreeShape,
    ancestor_mask,
    chain_shape,
    position_offsets,
    stack_drafts,
    tree_attention_mask,
)
from infer.speculative.verifier import verify_tree_greedy, verify_tree_logits, verify_tree_nodes

# ---------------------------------------------------------------- TreeShape


def test_shape_3_2_1_1_nodes_parents_depths_children() -> None:
    shape = TreeShape.parse("3, 2,1,1")
    assert shape == TreeShape((3, 2, 1, 1)) and str(shape) == "3,2,1,1"
    assert (shape.num_nodes, shape.depth, shape.num_uniforms) == (21, 4, 3 + 2 + 1 + 1 + 1)
    assert shape.parents == (-1, -1, -1, 0, 0, 1, 1, 2, 2, *range(3, 9), *range(9, 15))
    assert shape.depths == (1,) * 3 + (2,) * 6 + (3,) * 6 + (4,) * 6
    assert shape.root_children == (0, 1, 2)
    assert shape.children[:3] == ((3, 4), (5, 6), (7, 8))
    assert shape.children[3] == (9,) and shape.children[14] == (20,) and shape.children[20] == ()
    assert shape.paths[19] == (2, 7, 13, 19)  # 19 -> 13 -> 7 -> 2 -> the root
    assert shape.level_starts == (0, 3, 9, 15, 21) and shape.uniform_offsets == (0, 3, 5, 6)
    assert hash(shape) == hash(TreeShape.parse("3,2,1,1"))


def test_shape_paths_follow_parents() -> None:
    shape = TreeShape.parse("2,3,2")
    for node in range(shape.num_nodes):
        path, up = [node], shape.parents[node]
        while up >= 0:
            path.insert(0, up)
            up = shape.parents[up]
        assert shape.paths[node] == tuple(path) and len(path) == shape.depths[node]


def test_masks_and_positions_for_shape_2_2() -> None:
    shape = TreeShape.parse("2,2")  # nodes 0, 1 at depth 1; 2, 3 under 0; 4, 5 under 1
    t, f = True, False
    expected = [[t, f, f, f, f, f],
                [f, t, f, f, f, f],
                [t, f, t, f, f, f],
                [t, f, f, t, f, f],
                [f, t, f, f, t, f],
                [f, t, f, f, f, t]]
    assert ancestor_mask(shape).tolist() == expected
    block = tree_attention_mask(shape)  # [g, nodes]
    assert block.shape == (7, 7) and block[0].tolist() == [t] + [f] * 6
    assert block[1:, 0].all() and block[1:, 1:].tolist() == expected
    assert position_offsets(shape).tolist() == [0, 1, 1, 2, 2, 2, 2]


def test_chain_shape_is_a_causal_chain() -> None:
    shape = chain_shape(4)
    assert shape == TreeShape.parse("1,1,1,1") and shape.parents == (-1, 0, 1, 2)
    assert torch.equal(tree_attention_mask(shape), torch.ones(5, 5, dtype=torch.bool).tril())
    assert position_offsets(shape).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="chain"):
        chain_shape(0)


@pytest.mark.parametrize(("text", "message"), [
    ("", "comma-separated integers"),
    ("3,,1", "comma-separated integers"),
    ("3,x", "comma-separated integers"),
    ("-1,2", "comma-separated integers"),
    ("3,0,1", "integers >= 1.*depth 2"),
    (",".join(["1"] * 33), "1 to 32 levels"),
    ("8,8,8", f"more than {MAX_TREE_NODES} nodes"),
])
def test_shape_parse_errors_say_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TreeShape.parse(text)


def test_shape_constructor_validates() -> None:
    assert TreeShape([2, 1]).branching == (2, 1)  # a list is taken as a tuple
    assert TreeShape((MAX_TREE_NODES,)).num_nodes == MAX_TREE_NODES  # the limit itself is fine
    assert chain_shape(MAX_TREE_DEPTH).depth == MAX_TREE_DEPTH
    for bad in [(), (True, 1), (2.0,), "3,2", (1,) * (MAX_TREE_DEPTH + 1), (MAX_TREE_NODES + 1,)]:
        with pytest.raises(ValueError, match="tree shape"):
            TreeShape(bad)  # type: ignore[arg-type]


def test_tree_draft_validation_and_stacking() -> None:
    shape = TreeShape.parse("2,1")  # nodes 0, 1; 2 under 0; 3 under 1
    draft = Draft(shape, (5, 6, 7, 0), (True, True, True, False))
    assert draft.num_proposed == 3 and draft.probs is None
    assert Draft.empty(shape).num_proposed == 0
    with pytest.raises(ValueError, match="parent 1 is absent"):
        Draft(shape, (5, 0, 7, 8), (True, False, True, True))
    with pytest.raises(ValueError, match="0 at absent"):
        Draft(shape, (5, 6, 7, 8), (True, True, True, False))
    with pytest.raises(ValueError, match="4 token ids"):
        Draft(shape, (5, 6, 7), (True, True, True))
    for token in (True, -1, 6.0):  # a bool, a negative id, a float at node 1
        with pytest.raises(ValueError, match="integers >= 0"):
            Draft(shape, (5, token, 7, 0), (True, True, True, False))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="True/False"):
        Draft(shape, (5, 6, 7, 0), (True, 1, True, False))  # type: ignore[arg-type]
    assert TreeShape.parse("1,1,1").is_chain and not shape.is_chain
    tokens, valid = stack_drafts([draft, Draft.empty(shape)])
    assert tokens.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]] and valid.sum().item() == 3
    with pytest.raises(ValueError, match="one tree shape"):
        stack_drafts([draft, Draft.empty(chain_shape(4))])


# ---------------------------------------------------------------- verifier: the rule by hand


def _one_hot(tokens: list[int], v: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), v).double()


def test_second_child_accepted_from_the_residual_then_leaf_bonus() -> None:
    shape = TreeShape.parse("2,1")  # 0, 1 at depth 1; 2 under 0; 3 under 1
    p = torch.zeros(1, 5, 3, dtype=torch.float64)
    p[0, 0] = torch.tensor([0.5, 0.3, 0.2])  # after g
    p[0, 2] = torch.tensor([0.1, 0.1, 0.8])  # after node 1
    p[0, 4] = torch.tensor([0.0, 1.0, 0.0])  # after node 3 (the leaf): bonus token 1
    p[0, 1] = p[0, 3] = torch.tensor([1 / 3] * 3)
    q = torch.zeros(1, 4, 3, dtype=torch.float64)
    q[0, :2] = torch.tensor([0.2, 0.6, 0.2])  # siblings share their parent's q
    q[0, 2:] = torch.tensor([0.5, 0.25, 0.25])
    tokens = torch.tensor([[1, 0, 2, 2]])
    # child 0 (token 1): 0.3 / 0.6 = 0.5 < u = 0.7: rejected; residual max(p - q, 0) = one-hot(0)
    # child 1 (token 0): residual 1 / 0.2 -> accepted; node 3 (token 2): 0.8 / 0.25 -> accepted
    u = torch.tensor([[0.7, 0.99, 0.99, 0.5]], dtype=torch.float64)  # U = 2 + 1 + 1
    packed, nodes = verify_tree_nodes(shape, tokens, q, p, u)
    assert packed.tolist() == [[0, 2, 2, 1]] and nodes.tolist() == [[1, 3]]
    assert unpack_rows(packed.tolist()).tokens == [[0, 2, 1]]
    # u = 0.3 accepts child 0 instead; its child (node 2, token 2) is tested with u[2] = 0.99
    # against p after node 0 (uniform, ratio 1/3 / 0.25 > 1): accepted, bonus from p[3]
    u2 = torch.tensor([[0.3, 0.0, 0.99, 0.0]], dtype=torch.float64)
    packed, nodes = verify_tree_nodes(shape, tokens, q, p, u2)
    assert packed.tolist() == [[1, 2, 2, 0]] and nodes.tolist() == [[0, 2]]


def test_deterministic_duplicates_and_absent_children() -> None:
    shape = TreeShape.parse("3")
    p = torch.zeros(4, 4, 3, dtype=torch.float64)
    p[:, 0] = torch.tensor([0.5, 0.3, 0.2])
    p[:, 1:] = torch.tensor([0.0, 0.0, 1.0])  # after any child: bonus token 2
    tokens = torch.tensor([[1, 1, 2]] * 4)
    u = torch.tensor([[0.35, 0.0, 0.5, 0.99],  # token 1 rejected (0.3 < 0.35); its duplicate too,
                      # even at u = 0 (residual mass 0); token 2: 0.2 / 0.7 < 0.5 rejected, and
                      # the final token comes from [0.5, 0, 0] / 0.5: 0
                      [0.35, 0.0, 0.2, 0.5],  # token 2 accepted (0.2 < 2 / 7): bonus 2
                      [0.0, 0.25, 0.5, 0.99],  # child 0 absent (u = 0 would accept it); child 1
                      # is tested against the untouched p: 0.25 < 0.3, accepted
                      [0.0, 0.0, 0.0, 0.99]], dtype=torch.float64)  # all absent
    valid = torch.tensor([[True] * 3, [True] * 3, [False, True, True], [False] * 3])
    packed, nodes = verify_tree_nodes(shape, tokens, None, p, u, valid)
    assert packed.tolist() == [[0, 0, 0], [2, 1, 2], [1, 1, 2], [0, 0, 2]]
    assert nodes.tolist() == [[-1], [2], [1], [-1]]  # the last row: p itself, u = 0.99 -> 2


def test_greedy_rows_follow_the_argmax_child_for_any_uniforms() -> None:
    gen = torch.Generator().manual_seed(3)
    shape, b, v = TreeShape.parse("3,2,2"), 3000, 5
    target = torch.randint(0, v, (b, shape.num_nodes + 1), generator=gen)  # argmax per block row
    p = _one_hot(target.flatten().tolist(), v).view(b, -1, v)  # [B, N+1, V]
    tokens = torch.randint(0, v, (b, shape.num_nodes), generator=gen)
    q = torch.softmax(torch.randn(b, shape.num_nodes, v, generator=gen) * 3, -1)
    valid = torch.rand(b, shape.num_nodes, generator=gen) < 0.9
    u = torch.rand(b, shape.num_uniforms, generator=gen, dtype=torch.float64)
    expected = verify_tree_greedy(shape, p, tokens, valid)
    for q_in in (q, None):
        packed, nodes = verify_tree_nodes(shape, tokens, q_in, p, u, valid)
        assert torch.equal(packed, expected[0]) and torch.equal(nodes, expected[1])
    assert 0 < int(expected[0][:, shape.depth].sum()) < b * shape.depth  # some accepted, some not


def test_greedy_walk_accepts_the_full_depth_on_argmax_drafts_and_stops_at_a_mismatch() -> None:
    shape, v = TreeShape.parse("2,2,1"), 6  # 2 + 4 + 4 = 10 nodes
    logits = torch.randn(1, shape.num_nodes + 1, v, generator=torch.Generator().manual_seed(4))
    argmax = logits.argmax(-1)[0]  # [N+1]
    # put the argmax path under the SECOND child at depth 1 and the FIRST at depth 2
    tokens = torch.full((1, shape.num_nodes), (int(argmax[0]) + 1) % v)
    tokens[0, 1] = argmax[0]  # node 1 (depth 1, second child)
    tokens[0, 4] = argmax[1 + 1]  # node 4: the first child of node 1
    tokens[0, 8] = argmax[1 + 4]  # node 8: the child of node 4
    packed, nodes = verify_tree_greedy(shape, logits, tokens)
    assert nodes.tolist() == [[1, 4, 8]]
    assert packed.tolist() == [[int(argmax[0]), int(argmax[2]), int(argmax[5]), 3, int(argmax[9])]]
    tokens[0, 4] = (int(argmax[2]) + 1) % v  # a mismatch at depth 2 (node 5 does not match either)
    tokens[0, 5] = (int(argmax[2]) + 2) % v
    packed, nodes = verify_tree_greedy(shape, logits, tokens)
    assert nodes.tolist() == [[1, -1, -1]]
    assert packed.tolist() == [[int(argmax[0]), 0, 0, 1, int(argmax[2])]]  # the argmax after node 1
    absent = torch.ones(1, shape.num_nodes, dtype=torch.bool)
    absent[0, 1] = False  # the matching child is absent: nothing accepted, emit the root's argmax
    packed, nodes = verify_tree_greedy(shape, logits, tokens, absent)
    assert packed.tolist() == [[0, 0, 0, 0, int(argmax[0])]] and nodes.tolist() == [[-1, -1, -1]]


# ---------------------------------------------------------------- verifier: equivalences


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_shape_equals_the_chain_verifier_token_for_token(with_q: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    b, k, v = 4000, 4, 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=gen) * 2, -1) if with_q else None
    drafts = torch.randint(0, v, (b, k), generator=gen)
    counts = torch.randint(0, k + 1, (b,), generator=gen)
    u = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)  # verify_logits' layout: K then 1
    chain = verify_tensors(drafts, counts, q, p, u[:, :k], u[:, k])
    valid = torch.arange(k)[None, :] < counts[:, None]  # a chain of fewer drafts: absent tail
    tree, nodes = verify_tree_nodes(chain_shape(k), drafts, q, p, u, valid)
    assert unpack_rows(tree.tolist()) == unpack_rows(chain.tolist())
    n = tree[:, k]  # (the chain rows keep their rejected drafts; the tree rows pad with 0)
    assert torch.equal(nodes, torch.where(torch.arange(k)[None, :] < n[:, None], torch.arange(k), -1))
    assert 0 < int(n.sum()) < int(counts.sum())


def test_chain_shape_equals_verify_logits_and_the_residual_fallback() -> None:
    gen = torch.Generator().manual_seed(9)
    b, k, v = 256, 3, 8
    logits = torch.randn(b, k + 1, v, generator=gen) * 2
    temps, greedy = torch.tensor([0.6, 1.0, 1.3, 1.0] * (b // 4)), torch.arange(b) % 4 == 3
    drafts = torch.randint(0, v, (b, k), generator=gen)
    counts = torch.full((b,), k)
    u = torch.rand(b, k + 1, generator=gen, dtype=torch.float64)
    for q in (None, torch.softmax(torch.randn(b, k, v, generator=gen), -1)):
        chain = verify_logits(logits, temps, greedy, drafts, counts, q, u)
        tree, _ = verify_tree_logits(chain_shape(k), logits, temps, greedy, drafts, q, u)
        assert unpack_rows(tree.tolist()) == unpack_rows(chain.tolist())
    # a rejected token that held all but 1e-13 of p: the residual is rounding noise, and both
    # verifiers draw from p itself (token 0 at u = 0.5, where the residual would give token 1)
    p = torch.tensor([[[1 - 1e-13, 1e-13], [0.5, 0.5]]], dtype=torch.float64)
    drafts, u = torch.tensor([[0]]), torch.tensor([[1 - 1e-14, 0.5]], dtype=torch.float64)
    chain = verify_tensors(drafts, torch.tensor([1]), None, p, u[:, :1], u[:, 1])
    assert chain.tolist() == [[0, 0, 0]]
    assert verify_tree_nodes(chain_shape(1), drafts, None, p, u)[0].tolist() == [[0, 0, 0]]


def test_uniform_columns_make_a_row_independent_of_its_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    shape, b, v = TreeShape.parse("3,2"), 64, 7
    p = torch.softmax(torch.randn(b, shape.num_nodes + 1, v, generator=gen), -1)
    q = torch.softmax(torch.randn(b, shape.num_nodes, v, generator=gen), -1)
    tokens = torch.randint(0, v, (b, shape.num_nodes), generator=gen)
    u = torch.rand(b, shape.num_uniforms, generator=gen, dtype=torch.float64)
    batch = verify_tree_nodes(shape, tokens, q, p, u)[0]
    for row in (0, 17, 63):
        sl = slice(row, row + 1)
        assert torch.equal(verify_tree_nodes(shape, tokens[sl], q[sl], p[sl], u[sl])[0], batch[sl])


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_tree_logits_equals_the_general_pipeline(with_q: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    shape, b, v = TreeShape.parse("2,2,1"), 48, 9
    temps = [0.0, 0.7, 1.0, 1.6] * (b // 4)
    logits = torch.randn(b, shape.num_nodes + 1, v, generator=gen) * 2
    q = torch.softmax(torch.randn(b, shape.num_nodes, v, generator=gen), -1) if with_q else None
    tokens = torch.randint(0, v, (b, shape.num_nodes), generator=gen)
    u = torch.rand(b, shape.num_uniforms, generator=gen, dtype=torch.float64)
    fused = verify_tree_logits(shape, logits, torch.tensor([t or 1.0 for t in temps]),
                               torch.tensor([t == 0 for t in temps]), tokens, q, u)
    w = shape.num_nodes + 1
    params = [SamplingParams(temperature=t) for t in temps for _ in range(w)]
    p = logits_to_probs(logits.reshape(b * w, v), params, None).view(b, w, v)
    general = verify_tree_nodes(shape, tokens, q, p, u)
    assert torch.equal(fused[0], general[0]) and torch.equal(fused[1], general[1])
    greedy_rows = torch.tensor([t == 0 for t in temps])
    walk = verify_tree_greedy(shape, logits[greedy_rows], tokens[greedy_rows])
    assert torch.equal(fused[0][greedy_rows], walk[0]) and torch.equal(fused[1][greedy_rows], walk[1])


@pytest.mark.parametrize(("name", "shape"), [
    ("node_tokens", (2, 5)), ("target_probs", (2, 8, 4)), ("draft_probs", (2, 7, 5)),
    ("uniforms", (2, 7)), ("node_valid", (2, 3)),
])
def test_verify_tree_rejects_bad_shapes(name: str, shape: tuple[int, ...]) -> None:
    tree = TreeShape.parse("3,2")  # N = 9, U = 6
    args = {"node_tokens": torch.zeros(2, 9, dtype=torch.long), "draft_probs": torch.full((2, 9, 4), 0.25),
            "target_probs": torch.full((2, 10, 4), 0.25), "uniforms": torch.zeros(2, 6, dtype=torch.float64),
            "node_valid": torch.ones(2, 9, dtype=torch.bool)}
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=name):
        verify_tree_nodes(tree, **args)


class _NoHostSync(TorchDispatchMode):
    """Fails on the ops that copy a tensor's value to the host or give data-dependent shapes."""

    FORBIDDEN: ClassVar[frozenset[str]] = frozenset(
        {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        assert name not in self.FORBIDDEN, f"host sync or dynamic shape: {func}"
        return func(*args, **(kwargs or {}))


def test_verifiers_make_no_host_sync() -> None:
    gen = torch.Generator().manual_seed(8)
    shape, b, v = TreeShape.parse("3,2,1"), 8, 6
    logits = torch.randn(b, shape.num_nodes + 1, v, generator=gen)
    q = torch.softmax(torch.randn(b, shape.num_nodes, v, generator=gen), -1)
    tokens = torch.randint(0, v, (b, shape.num_nodes), generator=gen)
    valid = torch.rand(b, shape.num_nodes, generator=gen) < 0.8
    u = torch.rand(b, shape.num_uniforms, generator=gen, dtype=torch.float64)
    temps, greedy = torch.ones(b), torch.arange(b) % 2 == 0
    with _NoHostSync():
        verify_tree_logits(shape, logits, temps, greedy, tokens, q, u, valid)
        verify_tree_logits(shape, logits, temps, greedy, tokens, None, u, valid)
        verify_tree_greedy(shape, logits, tokens, valid)
    with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
        logits.sum().item()  # the guard itself works


# ---------------------------------------------------------------- n-gram tree proposals

TOKENS = {w: i for i, w in enumerate("a b c d e f g x y z . p q r A B C D E s".split(), start=100)}


def ids(text: str) -> list[int]:
    return [TOKENS[w] for w in text.split()]


def test_ngram_top_continuations_rank_counts_then_recency_then_shorter_contexts() -> None:
    table = NgramTable()
    table.extend(ids("x a b . x a c . x a b . y a d . z a e . z a f"))
    # trigram "x a" -> b twice, c once; then bigram "a": f (newest of the singles), e, d
    assert table.top_continuations(ids("x a"), 2) == ids("b c")
    assert table.top_continuations(ids("x a"), 5) == ids("b c f e d")
    assert table.top_continuations(ids("x a"), 5)[0] == table.predict(ids("x a"))
    assert table.top_continuations(ids("q a"), 3) == ids("b f e")  # unseen "q a": bigram counts
    assert table.top_continuations(ids("q"), 3) == []


def test_prompt_lookup_top_continuations_take_each_match_length() -> None:
    table = PromptLookupTable()  # suffixes of 3 down to 1 tokens
    table.extend(ids("p q r A . s r B . q r C . p q r"))
    # "p q r" last continued with A, "q r" with C, "r" with C too (not repeated)
    assert table.top_continuations(ids("p q r"), 3) == ids("A C")
    assert table.top_continuations(ids("s r"), 3) == ids("B C")
    assert table.top_continuations(ids("z"), 3) == []


def test_ngram_tree_extends_the_context_along_each_path() -> None:
    table = NgramTable()
    table.extend(ids("a b c . a b d . a e f . a b c"))
    shape = TreeShape.parse("2,2,1")  # 0, 1; 2, 3 under 0; 4, 5 under 1; 6..9 under 2..5
    before, history = table.counts(), table.history
    draft = table.propose_tree(ids("a"), shape)
    assert table.counts() == before and table.history == history  # proposing changes nothing
    tok = dict(zip(range(shape.num_nodes), draft.token_ids))
    assert [tok[0], tok[1]] == ids("b e")  # after "a": b three times, e once
    assert [tok[2], tok[3]] == ids("c d")  # after "a b": c twice, d once (distinct)
    assert draft.valid[4] and tok[4] == ids("f")[0] and not draft.valid[5]  # after "a e": only f
    assert [tok[6], tok[7], tok[8]] == ids(". . .")  # after "a b c", "a b d", "a e f"
    assert not draft.valid[9]  # under an absent node: absent
    first_path = [draft.token_ids[n] for n in shape.paths[6]]
    assert first_path == table.propose(ids("a"), shape.depth)  # the first-child path is the chain
    for node in (-1, *range(shape.num_nodes)):  # siblings are distinct
        kids = shape.children[node] if node >= 0 else shape.root_children
        present = [draft.token_ids[k] for k in kids if draft.valid[k]]
        assert len(present) == len(set(present))


def test_tree_proposals_are_absent_where_nothing_matches() -> None:
    shape = TreeShape.parse("3,2")
    for table in (NgramTable(), PromptLookupTable()):
        assert table.propose_tree(ids("a b"), shape) == Draft.empty(shape)  # empty table
        table.extend(ids("a b c d"))
        assert table.propose_tree(ids("z z"), shape).num_proposed == 0
        draft = table.propose_tree(ids("b"), shape)  # b -> c -> d, nothing after d
        assert draft.valid == (True, False, False, True, False, False, False, False, False)
        assert draft.token_ids[0] == ids("c")[0] and draft.token_ids[3] == ids("d")[0]


def test_prompt_lookup_tree_branches_follow_different_matches() -> None:
    table = PromptLookupTable()
    table.extend(ids("p q r A B . s r C D . p q r"))
    before = table.history
    draft = table.propose_tree(ids("p q r"), TreeShape.parse("2,1"))  # 0, 1; 2 under 0; 3 under 1
    assert table.history == before
    assert draft.token_ids == tuple(ids("A C B D")) and all(draft.valid)


def test_proposer_propose_tree_syncs_and_leaves_tables_to_real_tokens() -> None:
    proposer = NgramProposer(NgramConfig(window=64))
    request = Request(request_id="r0", prompt_token_ids=ids("a b c . a b d . a b"),
                      sampling_params=SamplingParams())
    shape = TreeShape.parse("2,1")
    (draft,) = proposer.propose([request], shape, [shape.depth])
    assert draft.probs is None and draft.token_ids[:2] == tuple(ids("d c"))  # newest wins the tie
    table = proposer.table("r0")
    assert table is not None and table.history == request.all_token_ids  # no draft token entered
    request.output_token_ids += ids("c .")
    (draft,) = proposer.propose([request], shape, [shape.depth])
    assert proposer.table("r0") is table and table.history == request.all_token_ids
    assert draft.token_ids[0] == ids("a")[0]  # after "c .": a
    tokens, valid = stack_drafts(proposer.propose([request, request], shape, [shape.depth] * 2))
    assert tokens.shape == (2, shape.num_nodes) and bool(valid[:, 0].all())
