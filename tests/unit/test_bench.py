"""Benchmark harness (CPU): workload definitions, roofline and projection math, the
engine runner and the peer on a tiny checkpoint, JSON round trip, the CLI end to end.
No wall-clock assertions: only counts, structure and arithmetic."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest
import torch

from helpers.bench_rows import suite_overrides
from infer_bench import analysis, theory
from infer_bench.cli import add_bench_args, run_bench
from infer_bench.engine_runner import engine_config, run_engine
from infer_bench.harness import Harness, HarnessOptions
from infer_bench.measures import bandwidth_row, roofline_row
from infer_bench.peers import HFPeer, run_hf
from infer_bench.report import fmt, markdown
from infer_bench.results import BenchRun, Measurement, load_run, save_run
from infer_bench.roofline import copy_bandwidth, decode_roofline
from infer_bench.rows import index_rows
from infer.engine.step_costs import weight_bytes
from infer.engine.step_costs import StepCostConfig, measure_model_costs
from infer_bench.workloads import WORKLOADS, Workload, build_requests, code_edit_text
from infer.models.loading.loader import load_model
from infer.tokenization import Tokenizer

QUICK = StepCostConfig(context_len=16, max_seq_len=64, k_max=3, repeats=2, warmup=1)


# -- workloads ------------------------------------------------------------------------------
def test_named_workloads_match_the_issue():
    w1, w2, w2p, w5 = (WORKLOADS[n] for n in ("W1", "W2", "W2-prefix", "W5"))
    assert (w1.num_requests, w1.prompt_len, w1.output_len) == (1, (128, 128), (256, 256))
    assert (w2.num_requests, w2.prompt_len, w2.output_len) == (32, (32, 512), (64, 256))
    assert w2p.shared_prefix_len == 256 and w5.kind == "code_edit"


@pytest.mark.parametrize("bad", [
    dict(num_requests=0), dict(prompt_len=(10, 5)), dict(output_len=(0, 4)), dict(temperature=-1.0),
    dict(kind="chat"), dict(shared_prefix_len=-1),
])
def test_workload_validation(bad):
    with pytest.raises(ValueError):
        replace(WORKLOADS["W2"], **bad)


def test_code_edit_needs_a_head_shorter_than_half_the_prompt():
    with pytest.raises(ValueError, match="edit_head_tokens"):
        replace(WORKLOADS["W5"], prompt_len=(40, 40), edit_head_tokens=20)


def test_random_prompts_are_seeded_and_shaped():
    w2 = WORKLOADS["W2"]
    a, b = build_requests(w2, 1000), build_requests(w2, 1000)
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    assert len(a.requests) == 32
    assert all(32 <= len(r.prompt_ids) <= 512 and 64 <= r.max_tokens <= 256 for r in a.requests)
    assert all(0 <= t < 1000 for r in a.requests for t in r.prompt_ids)
    other = build_requests(replace(w2, seed=1), 1000)
    assert [r.prompt_ids for r in other.requests] != [r.prompt_ids for r in a.requests]


def test_shared_prefix_prompts_share_exactly_the_prefix():
    reqs = build_requests(WORKLOADS["W2-prefix"], 50_000).requests
    prefix = reqs[0].prompt_ids[:256]
    assert all(r.prompt_ids[:256] == prefix for r in reqs)
    assert len({tuple(r.prompt_ids[256:260]) for r in reqs}) > 1


def test_dummy_code_edit_prompt_repeats_its_start():
    (req,) = build_requests(WORKLOADS["W5"], 128_256).requests
    ids, head = req.prompt_ids, WORKLOADS["W5"].edit_head_tokens
    assert len(ids) == 640 and req.max_tokens == 256
    assert ids[-head:] == ids[:head]


def test_tokenizer_prompts_are_code(ckpt_a):
    tok = Tokenizer.from_pretrained(ckpt_a)
    (w1,) = build_requests(WORKLOADS["W1"], tok.vocab_size, tok).requests
    assert len(w1.prompt_ids) == 128
    text = tok.decode(w1.prompt_ids)
    assert any(word in text for word in ("def ", "import ", "class ", '"""'))


def test_code_edit_text_ends_with_the_files_first_lines(ckpt_a):
    tok = Tokenizer.from_pretrained(ckpt_a)
    source = "".join(f"line_{i} = {i} * {i}\n" for i in range(200))
    text = code_edit_text(source, tok, budget=300, head_tokens=12)
    body, head = text.split("\n\n", 1)
    assert source.startswith(head) and source.startswith(body)
    assert len(tok.encode(text, add_special_tokens=False)) <= 300
    assert len(tok.encode(head, add_special_tokens=False)) >= 12


def test_engine_config_is_sized_by_the_workload():
    cfg = engine_config(WORKLOADS["W2"], {"use_cuda_graphs": False}, device="cpu")
    assert cfg.max_batch_size == 32 and cfg.max_seq_len >= 512 + 256 and cfg.max_seq_len % 128 == 0
    assert engine_config(WORKLOADS["W1"], {"max_seq_len": 4096}, device="cpu").max_seq_len == 4096


# -- roofline and theory ----------------------------------------------------------------------
def test_roofline_math_on_known_numbers():
    roof = decode_roofline(6_000_000_000, 3.0e12)  # 6 GB of weights at 3 TB/s
    assert roof.step_s == pytest.approx(2e-3)
    assert roof.tokens_per_s == pytest.approx(500.0)
    run = BenchRun("t")
    run.add(Measurement("roofline", "roofline", metrics=roof.to_dict()))
    ours = run.add(Measurement("ours", "engine", metrics={"decode_tokens_per_s": 400.0}, refs={"roofline": "roofline"}))
    assert analysis.derive(ours, run)["roofline_fraction"] == pytest.approx(0.8)
    with pytest.raises(ValueError):
        decode_roofline(0, 1.0)


def test_weight_bytes_counts_tied_embeddings_once():
    meta, cfg = load_model("dummy:llama-3.2-1b", dtype="bf16", device="meta", load_format="dummy")
    assert cfg.tie_word_embeddings
    assert weight_bytes(meta) == cfg.num_parameters() * 2
    untied, cfg8 = load_model("dummy:llama-3.1-8b", dtype="bf16", device="meta", load_format="dummy")
    assert weight_bytes(untied) == cfg8.num_parameters() * 2


def test_copy_bandwidth_runs_on_cpu():
    threads = torch.get_num_threads()
    bw = copy_bandwidth("cpu", nbytes=1 << 20, repeats=3, warmup=1)
    assert bw.bytes_per_s > 0 and bw.probe_bytes == 1 << 20 and torch.get_num_threads() == threads
    assert len(bw.samples) in (3, 6)  # on one thread, then on every core (when there are several)


def test_cpu_bandwidth_is_the_best_copy_over_one_thread_and_every_core(monkeypatch):
    # contention on a shared CPU only slows a copy down: the roofline takes the fastest
    import infer_bench.roofline as rl
    seen, times = [], iter([[0.4, 0.1, 0.2], [0.3, 0.5, 0.6]])

    def timed(src, dst, repeats):
        seen.append(torch.get_num_threads())
        return next(times)

    monkeypatch.setattr(rl, "available_cores", lambda: 2)
    monkeypatch.setattr(rl, "_timed_copies", timed)
    threads = torch.get_num_threads()
    bw = rl.copy_bandwidth("cpu", nbytes=1 << 20, repeats=3, warmup=0)
    assert seen == [1, 2] and torch.get_num_threads() == threads
    assert bw.bytes_per_s == pytest.approx(2 * (1 << 20) / 0.1) and len(bw.samples) == 6


def test_projection_table():
    p = theory.projection_table(0.5, alphas=(0.6, 0.9), ks=(1, 2, 8))
    assert len(p.table) == 2 and len(p.table[0]) == 3
    assert p.table[1][2] == pytest.approx((1 - 0.9 ** 9) / (0.1 * (8 * 0.5 + 1)))
    assert p.best_k[0] == max((1, 2, 8), key=lambda k: (1 - 0.6 ** (k + 1)) / (0.4 * (k * 0.5 + 1)))
    costly = theory.projection_table(0.5, alphas=(0.9,), ks=(1, 2), verify_costs=[1.0, 2.0, 3.0])
    assert costly.table[0][1] == pytest.approx((1 - 0.9 ** 3) / (0.1 * (2 * 0.5 + 3.0)))
    with pytest.raises(ValueError):
        theory.projection_table(0.5, ks=(1, 4), verify_costs=[1.0, 1.0])


def test_tree_projection_against_the_best_chain():
    v = [1.0, 1.0, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2, 1.2]  # v(K), K = 0..8
    t = theory.tree_projection(0.4, v, alphas=(0.5, 0.9), trees=((1, 1, 1), (2, 1, 1), (4, 1)))
    assert t.to_dict()["trees"] == ["1,1,1", "2,1,1", "4,1"]
    # a tree of one child a level is the chain of its depth
    assert t.table[1][0] == pytest.approx(theory.walltime_factor(0.9, 3, 0.4, v[3]))
    assert t.table[0][1] == pytest.approx((1 + 0.75 * (1 + 0.5 + 0.25)) / (3 * 0.4 + v[6]))
    assert t.best_chain[0] == pytest.approx(max(theory.walltime_factor(0.5, k, 0.4, v[k]) for k in range(1, 9)))
    with pytest.raises(ValueError, match="node counts"):
        theory.tree_projection(0.4, v, trees=((3, 3),))  # 12 nodes: no v(12)


def test_efficiency_from_refs():
    run = BenchRun("t")
    run.add(Measurement("costs", "spec_costs", metrics={"c": 0.5, "verify_ratio": [1.0, 1.0, 1.0, 1.0]}))
    run.add(Measurement("plain", "engine", metrics={"primary_rate": 100.0, "first_output_ids": [1, 2, 3]},
                        params={"workload": {"temperature": 0.0}}))
    spec_engine = {"use_speculative_decoding": True, "spec_policy": "fixed", "spec_length": 3,
                   "speculative_method": "draft_model"}
    run.add(Measurement("spec", "engine", params={"engine": spec_engine, "workload": {"temperature": 0.0}},
                        metrics={"primary_rate": 150.0, "mean_accepted_length": 1 + 0.8 + 0.64 + 0.512,
                                 "first_output_ids": [1, 2, 9]},
                        refs={"baseline": "plain", "costs": "costs"}))
    analysis.derive_all(run)
    d = run.get("spec").derived
    predicted = (1 - 0.8 ** 4) / (0.2 * (3 * 0.5 + 1))
    assert d["speedup"] == pytest.approx(1.5)
    assert d["alpha_implied"] == pytest.approx(0.8, abs=1e-6)
    assert d["predicted_speedup"] == pytest.approx(predicted)
    assert d["efficiency"] == pytest.approx(1.5 / predicted)
    assert d["greedy_prefix_match"] == 2


# -- JSON -------------------------------------------------------------------------------------
def test_json_round_trip(tmp_path):
    run = BenchRun("suite-x", environment={"gpu": "Test GPU", "torch": "2.11"}, options={"a": 1})
    run.add(Measurement("bandwidth", "bandwidth", "roofline", metrics={"gb_per_s": 3000.0, "bytes_per_s": 3e12}))
    run.add(Measurement("w1/x/ours", "engine", "W1", params={"workload": WORKLOADS["W1"].to_dict()},
                        metrics={"primary_rate": 123.5, "tokens_per_s": 120.0}, refs={"roofline": "r"}))
    run.add(Measurement("w1/x/hf", "hf", "W1", status="error", error="RuntimeError: boom"))
    with pytest.raises(ValueError, match="duplicate"):
        run.add(Measurement("w1/x/hf", "hf"))
    path = save_run(run, tmp_path / "sub" / "r.json")
    back = load_run(path)
    assert back.to_dict() == json.loads(json.dumps(run.to_dict()))
    assert back.get("w1/x/hf").error == "RuntimeError: boom"
    assert back.get("w1/x/ours").params["workload"]["prompt_len"] == [128, 128]
    text = markdown(back)
    assert "Test GPU" in text and "w1/x/hf" in text


def test_markdown_tabulates_batch_sweeps():
    run = BenchRun("sweep", environment={"gpu": "Test GPU"})
    run.add(Measurement("batch/3b", "batch_sweep", "sweep",
                        metrics={"ms_per_step": {"1": 2.0, "4": 3.0}, "tokens_per_s": {"1": 500.0, "4": 1333.0}}))
    text = markdown(run)
    assert "| sweep | b=1 | b=4 | step ratio | of bytes limit |" in text
    assert "| batch/3b | 500 | 1333 | 1.5 | - |" in text


def test_load_run_rejects_other_json(tmp_path):
    (tmp_path / "x.json").write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="schema"):
        load_run(tmp_path / "x.json")
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "missing.json")


def test_fmt():
    assert fmt(None) == "-" and fmt(3) == "3" and fmt(0.123456) == "0.123" and fmt(12345.6) == "12346"


# -- running on a tiny checkpoint ----------------------------------------------------------------
def test_w1_runs_end_to_end_on_cpu(ckpt_a):
    wl = WORKLOADS["W1"].with_output_len(6)
    params, metrics = run_engine(wl, {"model": str(ckpt_a)}, device="cpu", warmup_tokens=2, repeats=3)
    assert metrics["output_tokens"] == metrics["expected_output_tokens"] == 6
    walls = metrics["wall_s_runs"]
    assert len(walls) == 3 and metrics["wall_s"] == sorted(walls)[1]  # the median run is reported
    assert all(0 <= i < 7 for i in metrics["slowest_step_runs"])  # (a prefill step, then 6 tokens' at most)
    assert [0 < ms <= w * 1e3 for ms, w in zip(metrics["slowest_step_ms_runs"], walls, strict=True)] == [True] * 3
    assert metrics["leaks"] == []
    assert metrics["tokens_per_s"] > 0 and metrics["ttft_mean_s"] > 0
    assert len(metrics["first_output_ids"]) == 6
    assert params["engine"]["max_batch_size"] == 1


def test_paired_run_alternates_with_its_baseline(ckpt_a, monkeypatch):
    # the adaptive-policy rows of the suites: each round times both engines, the baseline
    # first in even rounds and second in odd ones; the speedup is the median of the
    # per-round ratios, and the best-of ratio compares the two fastest runs
    import infer_bench.engine_runner as er
    order, timed = [], er.timed_run

    def recording(engine, workload, specs):
        order.append("spec" if engine.config.use_speculative_decoding else "base")
        return timed(engine, workload, specs)

    rates, rate = [], er.primary_rate  # called per round: this engine's, then the baseline's

    def recording_rate(metrics, num_requests):
        rates.append(rate(metrics, num_requests))
        return rates[-1]

    monkeypatch.setattr(er, "timed_run", recording)
    monkeypatch.setattr(er, "primary_rate", recording_rate)
    wl = WORKLOADS["W1"].with_output_len(6)
    spec = {"model": str(ckpt_a), "use_speculative_decoding": True, "speculative_method": "ngram",
            "spec_policy": "adaptive"}
    params, m = run_engine(wl, spec, device="cpu", warmup_tokens=2, repeats=3, paired_with={"model": str(ckpt_a)})
    assert order == ["base", "spec", "spec", "base", "base", "spec"]
    base_walls, walls = m["paired_baseline_wall_s_runs"], m["wall_s_runs"]
    assert len(base_walls) == len(walls) == 3 and params["paired_with"] == {"model": str(ckpt_a)}
    assert len(m["paired_ratios"]) == 3 and m["paired_speedup"] == sorted(m["paired_ratios"])[1]
    assert all(r > 0 for r in m["paired_ratios"]) and m["leaks"] == []
    # (rates are taken for this engine's runs, then the baseline's)
    assert m["paired_best_speedup"] == pytest.approx(max(rates[0:3]) / max(rates[3:6]))
    assert m["paired_ratios"] == pytest.approx([a / b for a, b in zip(rates[0:3], rates[3:6])])
    run = BenchRun("t")
    run.add(Measurement("plain", "engine", metrics={"primary_rate": 100.0}))
    run.add(Measurement("adaptive", "engine", metrics={**m, "primary_rate": 50.0}, refs={"baseline": "plain"}))
    analysis.derive_all(run)
    d = run.get("adaptive").derived
    assert d["speedup"] == m["paired_speedup"] and d["speedup_unpaired"] == pytest.approx(0.5)
    assert "| adaptive (paired) |" in markdown(run)


def test_w2_counts_every_request_and_prefix_hits(ckpt_a):
    wl = replace(WORKLOADS["W2-prefix"], num_requests=4, prompt_len=(8, 24), output_len=(2, 5),
                 shared_prefix_len=48)
    expected = sum(r.max_tokens for r in build_requests(wl, 384, Tokenizer.from_pretrained(ckpt_a)).requests)
    _, metrics = run_engine(wl, {"model": str(ckpt_a), "block_size": 4, "max_num_batched_tokens": 64},
                            device="cpu", warmup_tokens=1)
    assert metrics["output_tokens"] == metrics["expected_output_tokens"] == expected
    assert metrics["prefix_query_tokens"] > 0 and metrics["prefix_hit_rate"] > 0


def test_speculative_run_reports_acceptance(ckpt_a):
    wl = WORKLOADS["W1"].with_output_len(11)
    _, m = run_engine(wl, {"model": str(ckpt_a), "use_speculative_decoding": True, "draft_model": str(ckpt_a),
                           "spec_length": 4}, device="cpu", warmup_tokens=3)
    assert m["output_tokens"] == 11
    assert m["acceptance_rate"] == 1.0  # the target drafting for itself
    assert m["spec_emitted_tokens"] == 10  # every token after the prefill one
    assert m["mean_accepted_length"] == pytest.approx(10 / m["spec_rounds"])


def test_hf_peer_generates_the_same_greedy_tokens(ckpt_a):
    wl = WORKLOADS["W1"].with_output_len(6)
    _, ours = run_engine(wl, {"model": str(ckpt_a)}, device="cpu", warmup_tokens=0)
    params, hf = run_hf(wl, HFPeer(str(ckpt_a)), device="cpu", warmup_tokens=2)
    assert hf["output_tokens"] == 6 and params["method"] == "plain"
    assert hf["first_output_ids"] == ours["first_output_ids"]


def test_spec_costs_on_cpu(ckpt_a):
    model, _ = load_model(str(ckpt_a), dtype="float32", device="cpu")
    costs = measure_model_costs(model, model, use_cuda_graphs=False, cfg=QUICK)
    assert len(costs.verify_s) == QUICK.k_max + 1 and costs.verify_ratio[0] > 0
    assert costs.c == pytest.approx(costs.draft_step_s / costs.target_step_s)
    assert math.isfinite(costs.c)


def test_failures_are_recorded_and_budget_skips(tmp_path):
    run = BenchRun("t")
    h = Harness(run, HarnessOptions(device="cpu", quiet=True), tmp_path / "r.json")

    def boom() -> tuple[dict, dict]:
        raise RuntimeError("peer exploded")

    m = h.measure("bad", "hf", "g", boom)
    assert m.status == "error" and "peer exploded" in m.error
    ok = h.measure("good", "bandwidth", "g", lambda: ({}, {"gb_per_s": 1.0}))
    assert ok.ok and load_run(tmp_path / "r.json").get("good") is not None
    h.options.max_seconds = 1e-9
    assert h.measure("late", "bandwidth", "g", lambda: ({}, {})).status == "skipped"


def test_the_fp8_roofline_counts_fp8_bytes(tmp_path):
    run = BenchRun("t")
    rows = [bandwidth_row(), roofline_row("1b", "dummy:llama-3.2-1b"), roofline_row("1b", "dummy:llama-3.2-1b", "fp8")]
    Harness(run, HarnessOptions(device="cpu", quiet=True)).run_rows([r.name for r in rows], index_rows(rows))
    dense, fp8 = run.get("roofline/1b"), run.get("roofline/1b-fp8")
    assert dense.ok and fp8.ok and fp8.refs == {"bandwidth": "bandwidth"}
    # layers at one byte a weight, the tied embedding (and lm_head) in the model's dtype
    assert 0.3 < fp8.metrics["weight_bytes"] / dense.metrics["weight_bytes"] < 0.7
    assert fp8.metrics["tokens_per_s"] > dense.metrics["tokens_per_s"]


def _cli_args(argv: list[str]):
    import argparse
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(argv)


def test_cli_workload_run_writes_json(ckpt_a, tmp_path, capsys):
    out = tmp_path / "w1.json"
    args = _cli_args(["--workload", "W1", "--model", str(ckpt_a), "--device", "cpu", "--output-len", "4",
                      "--warmup-tokens", "1", "--hf", "--out", str(out)])
    assert run_bench(args) == 0
    run = load_run(out)
    names = [m.name for m in run.measurements]
    assert names[0] == "bandwidth" and any(n.endswith("/ours") for n in names) and any(n.endswith("/hf") for n in names)
    ours = next(m for m in run.measurements if m.name.endswith("/ours"))
    assert ours.ok and ours.metrics["output_tokens"] == 4
    assert ours.derived["roofline_fraction"] > 0
    hf = next(m for m in run.measurements if m.name.endswith("/hf"))
    assert hf.ok and hf.derived["greedy_prefix_match"] == 4
    assert "bandwidth" in capsys.readouterr().out


def test_cli_smoke_suite_and_report(ckpt_a, tmp_path, capsys):
    out = tmp_path / "smoke.json"
    args = _cli_args(["--suite", "smoke", "--model", str(ckpt_a), "--device", "cpu", "--output-len", "5",
                      "--warmup-tokens", "1", "--cost-repeats", "2", "--no-hf", "--out", str(out)])
    assert run_bench(args) == 0
    run = load_run(out)
    failed = [(m.name, m.error) for m in run.measurements if not m.ok]
    assert failed == [("smoke/hf", "left out (--no-hf)"), ("smoke/hf-assisted", "left out (--no-hf)")]
    assert {m.kind for m in run.measurements} >= {"bandwidth", "roofline", "spec_costs", "projection", "engine"}
    spec = run.get("smoke/spec-k4")
    assert spec.metrics["acceptance_rate"] == 1.0 and "efficiency" in spec.derived
    plain_json, spec_json = run.get("smoke/plain-json"), run.get("smoke/spec-k4-json")
    assert plain_json.params["workload"]["structured"]["json"].startswith('{"type":"array"')
    assert plain_json.metrics["first_output_ids"] != run.get("smoke/plain").metrics["first_output_ids"]
    assert "greedy_prefix_match" not in plain_json.derived and plain_json.derived["speedup"] > 0  # (its cost)
    assert spec_json.derived["greedy_prefix_match"] == 5 and spec_json.metrics["acceptance_rate"] is not None
    capsys.readouterr()
    assert run_bench(_cli_args(["--report", str(out)])) == 0
    assert "Projected speedup" in capsys.readouterr().out


def test_cli_needs_a_suite_or_workload():
    with pytest.raises(ValueError, match="--suite"):
        run_bench(_cli_args([]))


def test_missing_demo_models_skip_their_rows_with_a_hint(tmp_path, monkeypatch):
    from infer_bench import suites
    monkeypatch.setattr(suites, "DEMO_TARGET", tmp_path / "nope-target")
    monkeypatch.setattr(suites, "DEMO_DRAFT", tmp_path / "nope-draft")
    options = HarnessOptions(device="cpu", quiet=True)
    table, selected = suites.suite_rows("speculation", options)
    run = BenchRun("speculation")
    Harness(run, options).run_rows([n for n in selected if n.startswith("demo-")], table)
    assert run.measurements and {m.status for m in run.measurements} == {"skipped"}
    assert all("python -m demo_pair" in m.error and "nope-target" in m.error for m in run.measurements)


def test_workload_label_and_dict():
    w = WORKLOADS["W5"].with_temperature(1.0)
    assert w.label == "W5 T=1" and w.to_dict()["kind"] == "code_edit"
    assert isinstance(Workload("x", 1, (1, 1), (1, 1)).max_total_tokens, int)
    assert torch.tensor(build_requests(WORKLOADS["W1"], 7).requests[0].prompt_ids).max() < 7


def test_paired_run_with_several_instances_pools_them(ckpt_a, monkeypatch):
    # identical engines in one process differ by a few percent: with paired_instances = 2
    # each round times two engines of each kind, pairs alternating in order, and every
    # instance's rate is compared with the mean of the round's baseline rates
    import infer_bench.engine_runner as er
    order, timed, engine_cls = [], er.timed_run, er.Engine
    names: dict[int, str] = {}  # id(engine) -> "spec0", "base1", ... in build order per kind

    def naming(config):
        engine = engine_cls(config)
        kind = "spec" if config.use_speculative_decoding else "base"
        names[id(engine)] = kind + str(sum(1 for n in names.values() if n.startswith(kind)))
        return engine

    def recording(engine, workload, specs):
        order.append(names[id(engine)])
        return timed(engine, workload, specs)

    rates, rate = [], er.primary_rate

    def recording_rate(metrics, num_requests):
        rates.append(rate(metrics, num_requests))
        return rates[-1]

    monkeypatch.setattr(er, "Engine", naming)
    monkeypatch.setattr(er, "timed_run", recording)
    monkeypatch.setattr(er, "primary_rate", recording_rate)
    wl = WORKLOADS["W1"].with_output_len(6)
    spec = {"model": str(ckpt_a), "use_speculative_decoding": True, "speculative_method": "ngram",
            "spec_policy": "adaptive"}
    _, m = run_engine(wl, spec, device="cpu", warmup_tokens=2, repeats=2, paired_with={"model": str(ckpt_a)},
                      paired_instances=2)
    assert sorted(names.values()) == ["base0", "base1", "spec0", "spec1"]
    assert order == ["base0", "spec0", "spec1", "base1", "spec0", "base0", "base1", "spec1"]
    ours, base = [rates[0:2], rates[2:4]], [rates[4:6], rates[6:8]]  # [instance][round]
    expected = [ours[i][k] / ((base[0][k] + base[1][k]) / 2) for i in range(2) for k in range(2)]
    assert m["paired_ratios"] == pytest.approx(expected)
    assert m["paired_speedup"] == pytest.approx(statistics.median(expected))
    assert m["paired_instance_speedups"] == pytest.approx([(expected[0] + expected[1]) / 2,
                                                           (expected[2] + expected[3]) / 2])
    assert len(m["wall_s_runs"]) == 2 and m["leaks"] == []
    with pytest.raises(ValueError, match="paired_instances"):
        run_engine(wl, spec, device="cpu", paired_with={"model": str(ckpt_a)}, paired_instances=0)



def test_batch_sweep_times_steps_at_each_batch_size_and_plots_them(ckpt_a, tmp_path):
    from infer_bench.batch_sweep import batch_sweep
    from infer_bench.plot import plot_batch_sweeps
    params, metrics = batch_sweep({"model": str(ckpt_a)}, (1, 3), prompt_len=8, steps=3, device="cpu")
    assert set(metrics["ms_per_step"]) == {"1", "3"} and metrics["leaks"] == []
    assert metrics["step_vs_batch1"]["1"] == 1.0
    assert metrics["tokens_per_s"]["3"] == pytest.approx(3 / metrics["ms_per_step"]["3"] * 1e3)
    # the bytes limit's inputs: weights, K and V of a token (the checkpoint's layers, float32) and
    # the context of the timed steps: past the prompt and the warm-up steps, within the timed ones
    meta, config = load_model(ckpt_a, device="meta", load_format="dummy")
    assert metrics["weight_bytes"] == weight_bytes(meta)
    assert metrics["kv_bytes_per_token"] == 2 * config.num_hidden_layers * config.num_key_value_heads \
        * config.head_dim * 4
    assert all(8 + 4 <= metrics["context_tokens"][b] <= 8 + 4 + 3 + 3 for b in ("1", "3"))
    run = BenchRun(suite="t", environment={"device": "cpu"})
    run.add(Measurement("bandwidth", "bandwidth", metrics={"bytes_per_s": 1e9}))
    run.add(Measurement("batch/a", "batch_sweep", params=params, metrics=metrics, refs={"bandwidth": "bandwidth"}))
    analysis.derive_all(run)
    d = run.get("batch/a").derived
    assert d["of_bytes_limit_batch"] == 3 and d["of_bytes_limit"] == d["of_bytes_limit_by_batch"]["3"]
    assert d["bytes_limit_ms"]["3"] > d["bytes_limit_ms"]["1"] > metrics["weight_bytes"] / 1e9 * 1e3
    path = plot_batch_sweeps(run, tmp_path)
    assert path is not None and path.stat().st_size > 1000


def test_speculation_suite_runs_the_demo_targets_eagle3_head_beside_the_draft(monkeypatch):
    from infer_bench import suites
    _, overrides_of = suite_overrides(monkeypatch, "speculation", lambda n: n.endswith(("/eagle-k5", "/spec-k5")))
    assert {"demo-w1-t0/eagle-k5", "demo-w1-t1/eagle-k5"} <= set(overrides_of)
    for t in ("t0", "t1"):
        head, draft = overrides_of[f"demo-w1-{t}/eagle-k5"], overrides_of[f"demo-w1-{t}/spec-k5"]
        assert head["speculative_method"] == "eagle3" and head["draft_model"] == str(suites.DEMO_EAGLE3)
        assert head["spec_length"] == draft["spec_length"] == 5 and head["model"] == draft["model"]
    other = suites.suite_rows("speculation", HarnessOptions(device="cpu", quiet=True, model="dummy:llama-3.2-1b"))[0]
    assert not [n for n in other if n.endswith("/eagle-k5")]  # the demo head fits the demo target only


def test_a_timed_run_steps_with_the_objects_before_it_frozen_and_thaws_them(ckpt_a):
    # (a full collection triggered inside a run scans the run's own objects alone)
    import gc

    from infer_bench.engine_runner import timed_run
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=2, max_seq_len=256))
    frozen, step = [], engine.step

    def counting():
        frozen.append(gc.get_freeze_count())
        return step()

    engine.step = counting
    wl = WORKLOADS["W1"].with_output_len(4)
    before = gc.get_freeze_count()
    run = timed_run(engine, wl, build_requests(wl, engine.vocab_size, None).requests[:2])
    assert run.steps == len(frozen) > 0 and all(n > before for n in frozen)
    assert gc.get_freeze_count() == before and all(len(r.output_token_ids) == 4 for r in run.requests)
    assert 0 <= run.slowest_step < run.steps and 0 < run.slowest_step_s <= run.wall
