"""The benchmark's oracle proposer (CPU, tiny checkpoint): acceptance it controls, lossless
output, statistics of its draws, and that only the benchmark imports it."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest

from infer_bench.oracle import OracleProposer, trials
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.sampling import SamplingParams
from infer.speculative.tree import Draft, TreeShape, chain_shape

OUTPUT = 48
SRC = Path(__file__).resolve().parents[2] / "src" / "infer"


def _prompts(vocab: int, n: int = 4, length: int = 12) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _generate(engine: Engine, prompts: list[list[int]], temperature: float = 0.0) -> list[list[int]]:
    """Each prompt alone (batch 1), greedy, exactly OUTPUT tokens: prompt + output."""
    out = []
    for i, prompt in enumerate(prompts):
        request = engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=OUTPUT,
                                                            ignore_eos=True, seed=i))
        while engine.has_unfinished():
            engine.step()
        out.append(prompt + request.output_token_ids)
    return out


@pytest.fixture(scope="module")
def plain(ckpt_a) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, the target's greedy continuations of them)."""
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=1, max_seq_len=128))
    prompts = _prompts(engine.vocab_size)
    return prompts, _generate(engine, prompts)


def _oracle_engine(ckpt: Path, records: list[list[int]], alpha: float, **spec) -> tuple[Engine, OracleProposer]:
    engine = Engine(EngineConfig(model=str(ckpt), draft_model=str(ckpt), use_speculative_decoding=True, device="cpu",
                                 max_batch_size=1, max_seq_len=128, **spec))
    speculation = engine.runner.speculation
    oracle = OracleProposer(speculation.proposer, records, engine.vocab_size, alpha, seed=11)
    speculation.proposer = oracle
    return engine, oracle


SHAPES = [pytest.param({"spec_length": 3}, id="chain-3"), pytest.param({"spec_tree": "2,2"}, id="tree-2x2"),
          pytest.param({"spec_tree": "3,1,1"}, id="tree-3x1x1")]


@pytest.mark.parametrize("spec", SHAPES)
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_one_accepts_every_draft_and_zero_none(ckpt_a, plain, spec, alpha):
    prompts, records = plain
    engine, oracle = _oracle_engine(ckpt_a, records, alpha, **spec)
    assert _generate(engine, prompts) == records  # lossless
    stats = engine.runner.stats
    assert stats.drafts > 0 and oracle.counts.rounds == stats.drafts
    if alpha == 1.0:  # every round accepted down to its deepest proposed node
        assert stats.accepted_per_position == stats.drafted_per_position
        assert oracle.counts.acceptance == 1.0
    else:
        assert stats.accepted_tokens == 0 and oracle.counts.accepted == 0
    assert oracle.counts.off_record_rounds == 0
    assert engine.leak_report() == []


@pytest.mark.parametrize("spec", SHAPES)
def test_acceptance_at_one_half_is_one_half_and_output_is_plain(ckpt_a, plain, spec):
    prompts, records = plain
    engine, oracle = _oracle_engine(ckpt_a, records, 0.5, **spec)
    assert _generate(engine, prompts) == records
    counts, stats = oracle.counts, engine.runner.stats
    assert counts.accepted == stats.accepted_tokens  # the verifier accepted what the oracle counts
    assert counts.tried >= 150
    sigma = math.sqrt(0.25 / counts.tried)  # binomial standard error at 0.5
    assert abs(counts.acceptance - 0.5) <= 4 * sigma
    assert engine.leak_report() == []


def test_a_request_off_every_record_keeps_the_inner_drafts_and_stays_lossless(ckpt_a, plain):
    prompts, records = plain
    other = [[(t + 1) % 50 for t in prompts[0]]]
    engine, oracle = _oracle_engine(ckpt_a, records, 1.0, spec_length=3)
    reference = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=1, max_seq_len=128))
    assert _generate(engine, other) == _generate(reference, other)
    assert oracle.counts.off_record_rounds == oracle.counts.rounds > 0
    # the inner proposer is the target itself: its own drafts are all accepted
    assert oracle.counts.acceptance == 1.0


def test_the_oracle_needs_greedy_requests(ckpt_a, plain):
    prompts, records = plain
    engine, _ = _oracle_engine(ckpt_a, records, 0.5, spec_length=2)
    with pytest.raises(ValueError, match="temperature 0"):
        _generate(engine, prompts[:1], temperature=1.0)


@pytest.mark.parametrize("bad", [dict(alpha=1.5), dict(alpha=-0.1), dict(records=[]), dict(vocab_size=1)])
def test_bad_oracle_arguments_are_refused(bad):
    args = {"inner": None, "records": [[1, 2, 3]], "vocab_size": 10, "alpha": 0.5, **bad}
    with pytest.raises(ValueError):
        OracleProposer(**args)


# -- the draws on hand-made drafts ----------------------------------------------------------------
class _Fixed:
    """An inner proposer returning one fixed draft."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft

    def propose(self, requests, shape, depths):
        return [self.draft]


class _Request:
    request_id = "r"
    sampling_params = SamplingParams(temperature=0.0)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.num_computed_tokens = len(tokens) - 1

    def token_slice(self, lo, hi=None):
        return self.tokens[lo:hi]


def tree_draft(shape: TreeShape) -> Draft:
    return Draft(shape, tuple(range(7, 7 + shape.num_nodes)), (True,) * shape.num_nodes)


def test_alpha_one_puts_the_continuation_on_the_first_child_and_wrong_tokens_on_its_siblings():
    shape = TreeShape.parse("3,2")
    record = [4, 5, 6, 20, 21, 22]  # the request holds 4, 5, 6: nodes at depth d take record[2 + d]
    oracle = OracleProposer(_Fixed(tree_draft(shape)), [record], vocab_size=30, alpha=1.0)
    [draft] = oracle.propose([_Request(record[:3])], shape, [2])
    first, second = shape.root_children[0], shape.children[shape.root_children[0]][0]
    assert draft.token_ids[first] == 20 and draft.token_ids[second] == 21
    later = [draft.token_ids[k] for k in shape.root_children[1:]]
    assert 20 not in later and len(set(later)) == len(later)  # wrong, and distinct from each other
    assert draft.token_ids[shape.children[first][1]] != 21
    assert draft.probs is None and draft.valid == tree_draft(shape).valid


def test_alpha_zero_makes_every_first_level_node_wrong_and_keeps_absent_nodes_absent():
    shape = chain_shape(4)
    inner = Draft.chain(shape, [9, 9])  # two nodes present, two absent
    record = [1, 2, 3, 9, 9, 9]
    oracle = OracleProposer(_Fixed(inner), [record], vocab_size=10, alpha=0.0)
    [draft] = oracle.propose([_Request(record[:3])], shape, [2])
    assert draft.valid == inner.valid and draft.token_ids[0] != 9 and draft.token_ids[2:] == (0, 0)


@pytest.mark.parametrize("branching, valid, path, expected", [
    ((1, 1, 1), (True, True, True), [0, 1], (3, 2)),  # two accepted, the third tried and rejected
    ((1, 1, 1), (True, True, True), [0, 1, 2], (3, 3)),  # all accepted: nothing after the last
    ((1, 1, 1), (True, False, False), [], (1, 0)),
    ((3, 1), (True,) * 6, [], (3, 0)),  # all three candidates tried and rejected
    ((3, 1), (True,) * 6, [1, 4], (3, 2)),  # the first candidate failed, the second and its child held
    ((3, 1), (True,) * 6, [2], (4, 1)),  # two failed, the third held, its child rejected
])
def test_trials_follow_the_accepted_path(branching, valid, path, expected):
    shape = TreeShape(branching)
    draft = Draft(shape, tuple(i + 1 if ok else 0 for i, ok in enumerate(valid)), valid)
    assert trials(draft, path) == expected


def test_the_engine_never_imports_the_benchmarks_or_their_oracle():
    importers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.split(".")[0] == "infer_bench" for n in names):
                importers.append(str(path.relative_to(SRC)))
    assert importers == []
    text = (SRC.parent / "infer_bench" / "oracle.py").read_text(encoding="utf-8")
    assert "Used only by the benchmark" in text and "Bench only" in text
