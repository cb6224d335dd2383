"""The benchmark table (CPU, no timing asserted): each row defined once, suites as selections
of it, refs run first, unmet needs skip a row with a hint, failures set the exit status,
progress is printed while a row runs, and the cost measurement runs on the engine's threads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from infer_bench import measures, suites
from infer_bench.cli import exit_status
from infer_bench.harness import Harness, HarnessOptions
from infer_bench.results import BenchRun
from infer_bench.rows import Module, Row, index_rows, with_refs
from infer.engine.threads import auto_threads, available_cores
from infer.models.loading.loader import load_model

from helpers.foreign_vocab import narrow_draft

RECORDS = Path(__file__).resolve().parents[2] / "bench-results"
# rows of the recorded runs that no suite produces any more: a drift probe at the end of
# all-gpu, and the random-draft rows' own plain run (they compare with w1/3b/ours now)
RETIRED = {"bandwidth-end", "w1-spec/3b/plain"}


def _row(name: str, refs: dict | None = None, needs: tuple = (), fail: bool = False) -> Row:
    def run(ctx):
        if fail:
            raise RuntimeError(f"{name} broke")
        return {}, {"value": 1}

    return Row(name, f"test row {name}", "engine", "g", run, refs or {}, needs)


def test_suites_select_rows_defined_once_and_all_gpu_is_their_union():
    table, owned = suites.build_table(HarnessOptions(device="cpu"))
    assert len(suites.SUITES) <= 9 and set(owned) == set(suites.SUITES)
    own = [name for suite, rows in owned.items() if suite != "all-gpu" for name in rows]
    assert len(own) == len(set(own)), "a row is selected by two suites"
    one_gpu = [s for s, suite in suites.SUITES.items()
               if suite.rows is not None and suite.gpus == 1 and suite.in_all_gpu]
    assert one_gpu == ["decode-speed", "speculation", "costs", "w2"]
    assert not suites.SUITES["acceptance-sweep"].in_all_gpu  # it runs on its own
    assert owned["all-gpu"] == [name for s in one_gpu for name in owned[s]]
    assert set(own) | {"bandwidth"} == set(table)  # only the bandwidth probe belongs to no suite


def test_every_recorded_measurement_still_has_its_row():
    table, _ = suites.build_table(HarnessOptions(device="cpu"))
    for name in ("all-gpu-h200", "speculation-h200", "w2-h200", "tp-h200x2", "tp-sync-h200x2"):
        recorded = {m["name"] for m in json.loads((RECORDS / f"{name}.json").read_text())["measurements"]}
        assert recorded - RETIRED <= set(table), (name, sorted(recorded - RETIRED - set(table)))


def test_a_row_is_defined_once_and_refers_to_rows_of_the_table():
    with pytest.raises(ValueError, match="defined twice"):
        index_rows([_row("a"), _row("a")])
    with pytest.raises(ValueError, match="not in the table"):
        index_rows([_row("a", {"baseline": "b"})])
    with pytest.raises(ValueError, match="itself"):
        _row("a", {"baseline": "a"})


def test_refs_run_first_once_and_circles_are_refused():
    table = index_rows([_row("bw"), _row("roof", {"bandwidth": "bw"}), _row("base", {"roofline": "roof"}),
                        _row("spec", {"baseline": "base", "roofline": "roof"})])
    assert with_refs(["spec", "base"], table) == ["bw", "roof", "base", "spec"]
    circle = {"a": _row("a", {"x": "b"}), "b": _row("b", {"x": "a"})}
    with pytest.raises(ValueError, match="circle"):
        with_refs(["a"], circle)


def test_unmet_needs_skip_with_a_hint_and_only_errors_fail_the_run():
    absent = Module("no_such_package_for_infer", "no-such-package>=1")
    table = index_rows([_row("fine"), _row("needs-it", {"baseline": "fine"}, (absent,))])
    run = BenchRun("t")
    Harness(run, HarnessOptions(device="cpu", quiet=True)).run_rows(["needs-it"], table)
    skipped = run.get("needs-it")
    assert skipped.status == "skipped" and "pip install 'no-such-package>=1'" in skipped.error
    assert run.get("fine").ok and exit_status(run) == 0
    Harness(run, HarnessOptions(device="cpu", quiet=True)).run_rows(["broken"], {"broken": _row("broken", fail=True)})
    assert run.get("broken").status == "error" and exit_status(run) == 1


def test_a_projection_of_failed_costs_is_skipped_not_a_second_error():
    table = index_rows([_row("costs", fail=True), measures.projection_row("projection", "costs")])
    run = BenchRun("t")
    Harness(run, HarnessOptions(device="cpu", quiet=True)).run_rows(["projection"], table)
    assert run.get("costs").status == "error"
    assert run.get("projection").status == "skipped" and "costs" in run.get("projection").error


def test_progress_is_printed_before_a_row_finishes(capsys):
    seen = []

    def run(ctx):
        seen.append(capsys.readouterr().err)  # what was printed while this row runs
        return {}, {}

    table = index_rows([_row("first"), Row("second", "the slow one", "engine", "g", run, {"x": "first"})])
    Harness(BenchRun("t"), HarnessOptions(device="cpu")).run_rows(["second"], table)
    assert "[2/2] second: the slow one" in seen[0]


def test_smoke_without_transformers_skips_the_peers_with_a_hint(ckpt_a, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    options = HarnessOptions(device="cpu", quiet=True, model=str(ckpt_a), output_len=3, warmup_tokens=1, repeats=1)
    table, selected = suites.suite_rows("smoke", options)
    run = BenchRun("smoke")
    Harness(run, options).run_rows([n for n in selected if n.startswith("smoke/hf") or n == "smoke/plain"], table)
    peers = [run.get("smoke/hf"), run.get("smoke/hf-assisted")]
    assert all(m.status == "skipped" and "pip install 'transformers" in m.error for m in peers)
    assert run.get("smoke/plain").ok and exit_status(run) == 0


def test_constrained_rows_without_xgrammar_are_skipped_with_a_hint(ckpt_a, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed (the GPU image)
    options = HarnessOptions(device="cpu", quiet=True, model=str(ckpt_a), output_len=3, warmup_tokens=1, repeats=1)
    table, _ = suites.suite_rows("smoke", options)
    run = BenchRun("smoke")
    Harness(run, options).run_rows(["smoke/plain-json", "smoke/spec-k4-json"], table)
    constrained = [run.get("smoke/plain-json"), run.get("smoke/spec-k4-json")]
    assert all(m.status == "skipped" and "pip install 'xgrammar" in m.error for m in constrained)
    assert run.get("smoke/plain").ok and exit_status(run) == 0


def test_costs_load_through_the_engine_and_run_on_its_threads(ckpt_a, monkeypatch):
    seen = []
    real = measures.measure_model_costs

    def recording(target, draft, graphs, cfg, head=None):
        seen.append((torch.get_num_threads(), draft is not None))
        return real(target, draft, graphs, cfg, head)

    monkeypatch.setattr(measures, "measure_model_costs", recording)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # neither the engine's choice for a tiny model (1) nor the one requested (2)
        for requested in (None, 2):
            options = HarnessOptions(device="cpu", quiet=True, cost_repeats=1, threads=requested)
            row = measures.costs_row("costs", "c", str(ckpt_a), str(ckpt_a), False)
            run = BenchRun("t")
            Harness(run, options).run_rows(["costs"], {"costs": row})
            m = run.get("costs")
            n_params = sum(p.numel() for p in load_model(str(ckpt_a), dtype="float32", device="cpu")[0].parameters())
            expected = requested or auto_threads(n_params, available_cores())
            assert expected == (requested or 1)
            assert m.ok and m.params["threads"] == expected and seen[-1] == (expected, True)
            assert m.metrics["c"] is not None
    finally:
        torch.set_num_threads(threads)


def test_costs_of_an_incompatible_draft_fail_with_the_engines_check(ckpt_a, tmp_path):
    other = narrow_draft(tmp_path / "narrow")  # a vocabulary sharing too little to draft over
    run = BenchRun("t")
    row = measures.costs_row("costs", "c", str(ckpt_a), str(other), False)
    Harness(run, HarnessOptions(device="cpu", quiet=True, cost_repeats=1)).run_rows(["costs"], {"costs": row})
    assert run.get("costs").status == "error" and "vocabulary" in run.get("costs").error.lower()


def test_every_result_file_the_docs_cite_is_kept():
    import re
    root = RECORDS.parent
    kept = {p.name for p in RECORDS.iterdir()}
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        cited = set(re.findall(r"`([\w.-]+-(?:h200|h200x\d|cpu)\.json)`", doc.read_text(encoding="utf-8")))
        assert cited <= kept, (doc.name, sorted(cited - kept))
