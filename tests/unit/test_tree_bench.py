"""Benchmark rows for tree speculation: the suites pair each tree with the chain verifying as
many tokens a round, the analysis compares their tokens per round (and makes no chain-formula
prediction for a tree), and an engine run reports the tree's counters."""

from __future__ import annotations

from types import SimpleNamespace

from infer.bench import suites
from infer.bench.analysis import derive
from infer.bench.results import BenchRun, Measurement
from infer.bench.workloads import WORKLOADS
from infer.speculative.tree import TreeShape


class _Recorder:
    """Stands in for a Harness: records engine rows, measures nothing."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[dict, dict]] = {}
        self.options = SimpleNamespace(model=None, draft_model=None)

    def engine(self, name, group, workload, overrides, refs=None, paired_with=None):
        self.rows[name] = (dict(overrides), dict(refs or {}))
        return SimpleNamespace(name=name)

    def spec_costs(self, name, *args, **kwargs):
        return SimpleNamespace(name=name)

    def projection(self, *args, **kwargs):
        return None

    def hf(self, *args, **kwargs):
        return None


def test_suites_pair_trees_with_chains_of_as_many_verified_tokens(monkeypatch):
    monkeypatch.setattr(suites, "demo_models_present", lambda h, suite: True)
    h = _Recorder()
    suites.demo_pair(h)  # type: ignore[arg-type]
    suites.w5_ngram(h)  # type: ignore[arg-type]
    trees = {name: row for name, row in h.rows.items() if "spec_tree" in row[0]}
    assert set(trees) == {"demo-w1-t0/spec-tree-2x1x1", "demo-w1-t0/spec-tree-3x1x1x1",
                          "demo-w1-t1/spec-tree-2x1x1", "demo-w1-t1/spec-tree-3x1x1x1",
                          "w5-t0/ngram-tree-2x1x1", "w5-t1/ngram-tree-2x1x1"}
    for name, (overrides, refs) in trees.items():
        shape = TreeShape.parse(overrides["spec_tree"])
        chain_overrides, _ = h.rows[refs["chain"]]
        assert chain_overrides["spec_length"] == shape.num_nodes  # K + 1 = N + 1 verified tokens
        assert overrides["spec_length"] == shape.depth and "costs" not in refs
        assert chain_overrides["speculative_method"] == overrides.get("speculative_method", "draft_model") \
            if "ngram" in name else "speculative_method" not in chain_overrides


def _measurement(name: str, engine: dict, mean_len: float, rate: float, refs: dict | None = None) -> Measurement:
    return Measurement(name, "engine", params={"engine": engine}, refs=refs or {},
                       metrics={"mean_accepted_length": mean_len, "primary_rate": rate})


def test_analysis_compares_a_tree_with_its_chain():
    run = BenchRun("t")
    spec = {"use_speculative_decoding": True, "spec_policy": "fixed", "speculative_method": "draft_model"}
    run.add(_measurement("plain", {}, 0.0, 100.0))
    run.add(Measurement("costs", "spec_costs", metrics={"c": 0.1, "verify_ratio": [1.0] * 8}))
    chain = run.add(_measurement("chain", {**spec, "spec_length": 6}, 2.0, 110.0, {"baseline": "plain",
                                                                                 "costs": "costs"}))
    tree = run.add(_measurement("tree", {**spec, "spec_length": 3, "spec_tree": "2,1,1"}, 2.6, 130.0,
                                {"baseline": "plain", "chain": "chain", "costs": "costs"}))
    assert derive(tree, run)["length_vs_chain"] == 1.3 and derive(tree, run)["speedup"] == 1.3
    assert "predicted_speedup" not in derive(tree, run) and "predicted_speedup" in derive(chain, run)


def test_an_engine_run_reports_tree_counters(ckpt_a):
    from infer.bench.engine_runner import run_engine
    wl = WORKLOADS["W1"].with_output_len(12)
    overrides = {"model": str(ckpt_a), "use_speculative_decoding": True, "draft_model": str(ckpt_a),
                 "spec_tree": "2,1"}
    params, metrics = run_engine(wl, overrides, device="cpu", warmup_tokens=2, repeats=1)
    assert params["engine"]["spec_tree"] == "2,1" and metrics["leaks"] == []
    # the target drafting for itself accepts as deep as it drafts (shallower near max_tokens)
    assert metrics["acceptance_by_depth"] == [1.0, 1.0]
    lengths = metrics["accepted_lengths"]
    assert lengths[0] == 0 and lengths[2] > 0
    assert metrics["mean_accepted_path"] == (lengths[1] + 2 * lengths[2]) / sum(lengths)
