"""A dynamic round is verified over the fewest levels and children its trees need
(`round_widths`), or as chains when every draft is one (suffix decoding's paths), and gives
exactly the tokens and paths of the verifier walking the full `DynamicShape` with the row's
own uniforms: greedy, temperature-only (the fused path) and top-k rows (the general one).
So a seeded row's tokens do not depend on the trees of the rows beside it."""

from __future__ import annotations

import random

import pytest
import torch

from infer.engine.request import Request
from infer.engine.verification import Verification
from infer.sampling import SamplingParams, logits_to_probs, round_uniforms, temperature_only
from infer.speculative.node_tree import DynamicShape, NodeTree, frame_of_trees, round_widths
from infer.speculative.tree import Draft, chain_shape
from infer.speculative.verifier import verify_tree_logits, verify_tree_nodes

SHAPE = DynamicShape(nodes=8, branch=3, depth=4)
VOCAB = 5
CPU = torch.device("cpu")


def _random_tree(rng: random.Random, path: bool) -> tuple[int, ...]:
    """Parents of a breadth-first tree of SHAPE (a path when `path`)."""
    if path:
        return tuple(range(-1, rng.randint(0, SHAPE.depth) - 1))
    parents: list[int] = []
    level, depth = [-1], 0
    while level and depth < SHAPE.depth and len(parents) < SHAPE.nodes:
        nxt = []
        for p in level:
            for _ in range(rng.randint(0, SHAPE.branch)):
                if len(parents) < SHAPE.nodes:
                    nxt.append(len(parents))
                    parents.append(p)
        level, depth = nxt, depth + 1
    return tuple(parents)


def _params(rng: random.Random) -> SamplingParams:
    return rng.choice([SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=rng.randrange(99)),
                       SamplingParams(temperature=0.8, top_k=3, seed=rng.randrange(99))])


def _reference(trees, tokens, params, logits) -> tuple[list[list[int]], list[list[int]]]:
    """The full shape's verifier on every row (uniforms of the shape's width from fresh
    generators; the fused path when every row samples with a temperature alone, as
    `Verification`): (emitted tokens, accepted nodes) per row."""
    width = SHAPE.num_uniforms - 1
    generators = [Request("r", [1], p).generator for p in params]
    proposed = [width if t.num_nodes else 0 for t in trees]
    uniforms = round_uniforms(generators, proposed, width)
    frame = frame_of_trees(trees, SHAPE.nodes, SHAPE.widths, CPU)
    node_tokens = torch.tensor([list(t) + [0] * (SHAPE.nodes - len(t)) for t in tokens])
    valid = torch.tensor([[i < tree.num_nodes for i in range(SHAPE.nodes)] for tree in trees])
    b = len(trees)
    if all(temperature_only(p, VOCAB) for p in params):
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
        packed, nodes = verify_tree_logits(frame, logits, temps, torch.tensor([p.greedy for p in params]),
                                           node_tokens, None, uniforms, valid)
    else:
        flat = [p for p in params for _ in range(SHAPE.nodes + 1)]
        probs = logits_to_probs(logits.reshape(b * (SHAPE.nodes + 1), VOCAB), flat, None).view(b, -1, VOCAB)
        packed, nodes = verify_tree_nodes(frame, node_tokens, None, probs, uniforms, valid)
    out_tokens, out_nodes = [], []
    for row, path in zip(packed.tolist(), nodes.tolist(), strict=True):
        accepted = row[SHAPE.depth]
        out_tokens.append(row[:accepted] + [row[SHAPE.depth + 1]])
        out_nodes.append([i for i in path if i >= 0])
    return out_tokens, out_nodes


@pytest.mark.parametrize("paths", [False, True])
def test_a_rounds_frame_verifies_as_the_full_shape(paths):
    rng = random.Random(7 + paths)
    torch.manual_seed(3)
    for _ in range(40):
        b = rng.randint(1, 4)
        parents = [_random_tree(rng, paths) for _ in range(b)]
        if not any(parents):
            continue
        trees = [NodeTree(p, SHAPE.widths) for p in parents]
        tokens = [tuple(rng.randrange(VOCAB) for _ in p) for p in parents]
        params = [_params(rng) for _ in range(b)]
        if paths:
            chain = chain_shape(max(len(p) for p in parents))
            drafts = [Draft.chain(chain, t) for t in tokens]
        else:
            drafts = [Draft(tree, t, (True,) * len(t)) for tree, t in zip(trees, tokens, strict=True)]
        requests = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
        logits = torch.randn(b, SHAPE.nodes + 1, VOCAB) * 2
        verification = Verification(VOCAB, CPU, SHAPE)
        block = verification.block(requests, drafts)
        assert (block.frame is None) == paths  # paths: verified as chains
        if not paths:
            assert block.frame.widths == round_widths(trees)
        flat = torch.cat([logits[i, :d.rows_used if not paths else d.num_proposed + 1]
                          for i, d in enumerate(drafts)])
        result, accepted = verification.verify(requests, drafts, block, flat, lambda: None)
        want_tokens, want_nodes = _reference(trees, tokens, params, logits)
        assert [list(t) for t in result.tokens] == want_tokens
        assert accepted == want_nodes


def test_round_widths_are_the_most_children_a_level_needs():
    trees = [NodeTree((-1, -1, 0, 0, 0, 3), SHAPE.widths), NodeTree((-1, 0, 1), SHAPE.widths),
             NodeTree((), SHAPE.widths)]
    assert round_widths(trees) == (2, 3, 1)
    with pytest.raises(ValueError, match="fit widths"):
        frame_of_trees(trees, SHAPE.nodes, (2, 2, 1), CPU)
