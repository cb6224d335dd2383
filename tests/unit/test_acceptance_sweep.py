"""The acceptance-sweep suite (CPU): its rows, a tiny run of them on a test checkpoint, and
the projections derived beside each row. No wall-clock assertions."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from infer_bench.analysis import sweep_projection
from infer_bench.cli import add_bench_args, run_bench
from infer_bench.harness import Harness, HarnessOptions
from infer_bench.measures import acceptance_sweep_rows
from infer_bench.report import markdown
from infer_bench.results import SWEEP_KIND, BenchRun, Measurement
from infer_bench.rows import index_rows
from infer_bench.suites import (EAGLE_SWEEP_CHAINS, SPEC_BATCHES, SWEEP_ALPHAS, SWEEP_CHAINS, SWEEP_TREES,
                                build_table)
from infer_bench.sweep import SWEEP_WORKLOAD, SweepSetup, SweepShape
from infer_bench.theory import num_nodes
from infer.speculative.theory import tree_expected_tokens


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(argv)


def test_the_suite_lists_every_shape_at_every_alpha_for_both_drafts(capsys):
    assert run_bench(_args(["--suite", "acceptance-sweep", "--list"])) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    shapes = [f"k{k}" for k in SWEEP_CHAINS] + ["tree-" + t.replace(",", "x") for t in SWEEP_TREES]
    expected = {f"sweep/3b-1b{q}/{s}/a{a:g}" for q in ("", "-fp8") for s in shapes for a in SWEEP_ALPHAS}
    assert expected <= set(names) and "sweep/3b-1b/k3/a0.8" in names and "sweep/3b-1b-fp8/tree-2x2/a0.8" in names
    eagle = {f"sweep/3b-eagle3/k{k}/a{a:g}" for k in EAGLE_SWEEP_CHAINS for a in SWEEP_ALPHAS}
    assert eagle <= set(names) and "sweep/3b-eagle3/k5/a0.8" in names
    vocab = {f"sweep/3b-1b{q}-v32k/{s}/a{a:g}" for q in ("", "-fp8", "-int4") for s in ("k2", "k3", "k4", "tree-2x2")
             for a in (0.6, 0.8)}
    assert vocab <= set(names) and "sweep/3b-1b-v32k/plain" in names
    # the plain baseline and the costs of each draft; the reduced vocabulary's own plain (its
    # costs are the costs suite's); the EAGLE-3 sweep's own plain and costs; at each larger
    # batch a plain row and one speculative row for each
    assert len(names) == len(expected) + 3 + len(vocab) + 1 + len(eagle) + 2 + len(SPEC_BATCHES) * 2 * 2
    assert names.index("sweep/3b-1b/plain") < names.index("sweep/3b-1b/k1/a0.6")


def test_the_sweep_stays_out_of_all_gpu():
    _, owned = build_table(HarnessOptions())
    assert not any(n.startswith("sweep/") for n in owned["all-gpu"])


@pytest.mark.parametrize("bad", [dict(alphas=(1.2,)), dict(alphas=()), dict(shapes=()),
                                 dict(workload=SWEEP_WORKLOAD.with_temperature(1.0)),
                                 dict(calibration_requests=5), dict(batch_size=5), dict(batch_size=0),
                                 dict(draft_vocab=0), dict(draft_vocab=64, method="eagle3", draft_quantizations=(None,))])
def test_bad_setups_are_refused(bad):
    with pytest.raises(ValueError):
        SweepSetup(**{"target": "t", "draft": "d", "label": "t-d", "shapes": (SweepShape.chain(2),),
                      "alphas": (0.8,), **bad})


def test_shapes_name_their_rows_and_engine_fields():
    assert SweepShape.chain(3) == SweepShape("k3", (1, 1, 1))
    assert SweepShape.chain(3).overrides() == {"spec_length": 3}
    tree = SweepShape.tree("2, 2,1")
    assert tree.tag == "tree-2x2x1" and tree.overrides() == {"spec_tree": "2,2,1"} and not tree.is_chain


def _run_sweep(setup: SweepSetup, names: list[str]) -> BenchRun:
    """The setup's rows (named `names`, in order) run on the CPU, one timed run each, every
    one ok."""
    rows = acceptance_sweep_rows(setup)
    assert [r.name for r in rows] == names
    run = BenchRun("acceptance-sweep")
    Harness(run, HarnessOptions(device="cpu", repeats=1, quiet=True)).run_rows(names, index_rows(rows))
    assert [(m.name, m.status) for m in run.measurements if not m.ok] == []
    return run


def test_a_reduced_vocabulary_sweep_runs_its_draft_on_the_lowest_ids(ckpt_a):
    workload = replace(SWEEP_WORKLOAD, num_requests=2, prompt_len=(16, 16), output_len=(16, 16))
    setup = SweepSetup(str(ckpt_a), str(ckpt_a), "a-a", (SweepShape.chain(2),), (1.0,), (None,), workload,
                       draft_vocab=64, costs=False, batch_gate=True)
    run = _run_sweep(setup, ["sweep/a-a-v64/plain", "sweep/a-a-v64/k2/a1"])
    spec = run.measurements[-1]
    assert spec.params["engine"]["spec_draft_vocab"] is not None and spec.derived["greedy_prefix_match"] > 0
    gate = spec.metrics["gate"]  # (the batch gate's view: each bucket's plain step and round)
    assert gate and all(set(b) == {"plain_ms", "round_ms", "round_tokens", "speedup", "rounds_on", "waited", "wait",
                                   "plain_steps", "round_steps", "plain_samples", "round_samples"}
                        for b in gate.values())


def test_a_tiny_sweep_runs_on_cpu_and_derives_its_projections(ckpt_a):
    workload = replace(SWEEP_WORKLOAD, num_requests=2, prompt_len=(16, 16), output_len=(24, 24))
    setup = SweepSetup(str(ckpt_a), str(ckpt_a), "a-a", (SweepShape.chain(2), SweepShape.tree("2,1")), (0.5, 1.0),
                       (None,), workload)
    rows = acceptance_sweep_rows(setup)
    run = BenchRun("acceptance-sweep")
    Harness(run, HarnessOptions(device="cpu", repeats=1, cost_repeats=2, quiet=True)).run_rows(
        [r.name for r in rows], index_rows(rows))
    assert [(m.name, m.status) for m in run.measurements if not m.ok] == []
    sweeps = [m for m in run.measurements if m.kind == SWEEP_KIND]
    assert [m.name for m in sweeps] == ["sweep/a-a/k2/a0.5", "sweep/a-a/k2/a1", "sweep/a-a/tree-2x1/a0.5",
                                        "sweep/a-a/tree-2x1/a1"]
    for m in sweeps:
        assert m.params["acceptance"].startswith("controlled acceptance")
        assert m.derived["speedup"] > 0 and m.derived["alpha"] == m.params["alpha"]
        assert 0 <= m.derived["acceptance"] <= 1
        assert m.derived["projected_speedup"] > 0 and "round_overhead_ms" in m.derived
        with_overhead = m.derived.get("projected_speedup_with_overhead")
        if with_overhead is None:  # left out where noisy CPU step timings over-count the whole round
            costs, n = run.get("sweep/a-a/costs").metrics, num_nodes(m.params["branching"])
            assert costs["verify_ratio"][n] + m.derived["round_overhead_ms"] / costs["target_step_ms"] <= 0
        else:
            assert with_overhead > 0
        assert m.derived["greedy_prefix_match"] == len(m.metrics["first_output_ids"])  # lossless
        assert m.metrics["output_tokens"] == m.metrics["expected_output_tokens"] == 48
        assert m.metrics["tokens_per_round_zero_acceptance"] == 1.0 and m.metrics["leaks"] == []
        assert m.metrics["oracle_off_record_rounds"] == 0
    assert [m.derived["acceptance"] for m in sweeps if m.params["alpha"] == 1.0] == [1.0, 1.0]
    plain = run.get("sweep/a-a/plain")
    assert plain.metrics["records_agree"] and plain.metrics["leaks"] == []
    text = markdown(run)
    assert "controlled acceptance (an oracle chooses which drafts match" in text
    assert "| k2 | 0.5 |" in text and "| tree-2x1 | 1 |" in text


def _measurement(alpha: float, branching: list[int], acceptance: float, round_zero: float | None) -> Measurement:
    return Measurement("sweep/x/s/a", SWEEP_KIND, params={"alpha": alpha, "branching": branching},
                       metrics={"oracle_acceptance": acceptance, "round_ms_zero_acceptance": round_zero})


def test_a_tiny_eagle3_sweep_runs_on_cpu(ckpt_a):
    # a dummy EAGLE-3 head of the test checkpoint's shape: the oracle wraps the head's proposer
    workload = replace(SWEEP_WORKLOAD, num_requests=1, prompt_len=(12, 12), output_len=(12, 12))
    setup = SweepSetup(str(ckpt_a), f"dummy-eagle3:{ckpt_a}", "a-eagle3", (SweepShape.chain(3),), (0.8,),
                       (None,), workload, method="eagle3")
    rows = acceptance_sweep_rows(setup)
    run = BenchRun("acceptance-sweep")
    Harness(run, HarnessOptions(device="cpu", repeats=1, cost_repeats=1, quiet=True)).run_rows(
        [r.name for r in rows], index_rows(rows))
    assert [(m.name, m.status) for m in run.measurements if not m.ok] == []
    (sweep,) = [m for m in run.measurements if m.kind == SWEEP_KIND]
    assert sweep.name == "sweep/a-eagle3/k3/a0.8" and sweep.params["engine"]["speculative_method"] == "eagle3"
    assert sweep.derived["speedup"] > 0 and sweep.metrics["oracle_rounds"] > 0 and sweep.metrics["leaks"] == []
    assert sweep.derived["greedy_prefix_match"] == len(sweep.metrics["first_output_ids"])  # lossless
    costs = next(m for m in run.measurements if m.name == "sweep/a-eagle3/costs")
    # the head's rounds were timed (its step, their slope, is floored at 0 against timing noise)
    assert costs.metrics["c"] is not None and costs.metrics["c"] >= 0
    assert costs.metrics["draft_step_ms"] is not None and costs.metrics["draft_round_fixed_ms"] is not None
    assert costs.metrics["draft_step_ms"] + costs.metrics["draft_round_fixed_ms"] > 0


def test_the_projection_adds_the_rounds_overhead_to_its_cost():
    verify = [1.0, 1.02, 1.04, 1.06, 1.08]
    costs = Measurement("costs", "spec_costs", metrics={"c": 0.5, "verify_ratio": verify, "target_step_ms": 2.0,
                                                        "draft_step_ms": 1.0})
    # tree 2,1: 4 nodes, depth 2; the round at acceptance 0 took 0.6 ms beyond 2 draft steps and v(4) target steps
    zero = 2 * 1.0 + verify[4] * 2.0 + 0.6
    out = sweep_projection(_measurement(0.8, [2, 1], 0.75, zero), costs, speedup=1.2)
    tokens = tree_expected_tokens(0.75, [2, 1])
    assert out["acceptance"] == 0.75 and out["alpha"] == 0.8
    assert out["projected_speedup"] == pytest.approx(tokens / (2 * 0.5 + verify[4]))
    assert out["round_overhead_ms"] == pytest.approx(0.6)
    assert out["projected_speedup_with_overhead"] == pytest.approx(tokens / (2 * 0.5 + verify[4] + 0.3))
    assert out["measured_vs_projection"] == pytest.approx(1.2 / out["projected_speedup_with_overhead"])
    # a chain of 3: the paper's factor with v(3)
    chain = sweep_projection(_measurement(0.8, [1, 1, 1], 0.8, None), costs, speedup=None)
    assert chain["projected_speedup"] == pytest.approx((1 + 0.8 + 0.64 + 0.512) / (3 * 0.5 + verify[3]))
    assert "projected_speedup_with_overhead" not in chain
    # v(N) not measured that far: no projection, the acceptance still reported
    wide = sweep_projection(_measurement(0.8, [3, 2], 0.8, zero), costs, speedup=1.0)
    assert wide["acceptance"] == 0.8 and "projected_speedup" not in wide


def test_the_suite_runs_each_draft_against_plain_at_larger_batches(capsys):
    assert run_bench(_args(["--suite", "acceptance-sweep", "--list"])) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    for b in SPEC_BATCHES:
        for label, shape in (("3b-1b", "k3"), ("3b-eagle3", "k4")):
            assert {f"sweep/{label}-b{b}/plain", f"sweep/{label}-b{b}/{shape}/a0.8"} <= set(names)
            assert f"sweep/{label}-b{b}/costs" not in names  # c and v(K) are batch-1 figures


def test_a_tiny_batch_sweep_compares_throughput_at_its_batch(ckpt_a):
    workload = replace(SWEEP_WORKLOAD, num_requests=3, prompt_len=(16, 16), output_len=(12, 12))
    setup = SweepSetup(str(ckpt_a), str(ckpt_a), "a-a-b3", (SweepShape.chain(2),), (1.0,), (None,), workload,
                       batch_size=3)
    plain, spec = _run_sweep(setup, ["sweep/a-a-b3/plain", "sweep/a-a-b3/k2/a1"]).measurements
    assert spec.metrics["gate"] is None  # (the gate off)
    for m in (plain, spec):
        assert m.params["batch_size"] == 3 and m.params["engine"]["max_batch_size"] == 3
        assert m.metrics["primary_rate"] == m.metrics["tokens_per_s"]  # the batch's throughput
    assert spec.metrics["acceptance_rate"] == 1.0  # alpha 1: every draft holds the continuation
    assert spec.derived["speedup"] == pytest.approx(spec.metrics["tokens_per_s"] / plain.metrics["tokens_per_s"])
    # beside it, the decode rates' ratio (the throughput counts the prompts' prefill too)
    assert spec.derived["decode_speedup"] == pytest.approx(spec.metrics["decode_tokens_per_s"] /
                                                           plain.metrics["decode_tokens_per_s"])
