"""Benchmark rows for tree speculation: the suites pair each tree with the chain verifying as
many tokens a round, the analysis compares their tokens per round (and makes no chain-formula
prediction for a tree), and an engine run reports the tree's counters."""

from __future__ import annotations

from helpers.bench_rows import suite_overrides
from infer_bench.analysis import derive
from infer_bench.results import BenchRun, Measurement
from infer_bench.workloads import WORKLOADS
from infer.speculative.tree import TreeShape


def test_suites_pair_trees_with_chains_of_as_many_verified_tokens(monkeypatch):
    table, overrides_of = suite_overrides(monkeypatch, "speculation", lambda n: "tree" in n)
    trees = {name: table[name] for name, o in overrides_of.items()  # (static trees: suffix's grow their own)
             if "spec_tree" in o and not o["spec_tree"].startswith("dynamic")}
    assert set(trees) == {"demo-w1-t0/spec-tree-2x1x1", "demo-w1-t1/spec-tree-2x1x1", "w5-ngram-t0/ngram-tree-2x1x1"}
    for name, row in trees.items():
        overrides, refs = overrides_of[name], row.refs
        shape = TreeShape.parse(overrides["spec_tree"])
        chain = overrides_of[refs["chain"]]  # the chain ran first, as the tree's ref
        assert chain["spec_length"] == shape.num_nodes  # K + 1 = N + 1 verified tokens
        assert overrides["spec_length"] == shape.depth and "costs" not in refs
        assert chain.get("speculative_method") == overrides.get("speculative_method")
        assert refs["baseline"] in overrides_of and "spec_tree" not in chain


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
    from infer_bench.engine_runner import run_engine
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
