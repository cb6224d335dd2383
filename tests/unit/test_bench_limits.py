"""The serving-throughput rows' arithmetic (CPU, nothing timed): prefill model FLOPs and MFU
against a GPU's peak (an unknown GPU says so), a decode step's bytes limit (weights + KV
read) against its measured time, and the rows `prefill/3b/16x2048`, `batch/3b/b128`,
`batch/3b/b256` in their suites, chosen by `--only`."""

from __future__ import annotations

import argparse

import pytest

from infer_bench import analysis, theory
from infer_bench.cli import add_bench_args, run_bench
from infer_bench.harness import Harness, HarnessOptions
from infer_bench.measures import prefill_row
from infer_bench.results import BenchRun, Measurement
from infer_bench.roofline import decode_step_bytes
from infer_bench.suites import build_table
from infer_bench.workloads import Workload
from infer.engine.batch_size import kv_bytes_per_token
from infer.models.loading.loader import load_model, model_shapes

ROWS = ("prefill/3b/16x2048", "batch/3b/b128", "batch/3b/b256")


def _config():
    return model_shapes["llama-3.2-3b"]


def test_attention_flops_count_the_visible_pairs():
    config = _config()
    per_pair = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    assert theory.attention_flops(config, 1) == per_pair  # one query sees itself
    assert theory.attention_flops(config, 3) == per_pair * (1 + 2 + 3)
    assert theory.attention_flops(config, 2, start=5) == per_pair * (6 + 7)  # a chunk after 5 cached tokens
    with pytest.raises(ValueError, match="chunk_len"):
        theory.attention_flops(config, -1)


def test_prefill_flops_of_the_3b_shape():
    config = _config()
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    layer = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 3 * h * i
    assert theory.layer_matmul_params(config) == layer
    flops = theory.prefill_flops(config, [2048] * 16)
    dense = 2 * config.num_hidden_layers * layer * 2048 * 16
    assert flops == dense + 2 * h * config.vocab_size * 16 + 16 * theory.attention_flops(config, 2048)
    # the 3B shape: ~2.8e9 weights a token multiplies (embedding aside), ~1.9e14 FLOPs in all
    assert 2.7e9 < config.num_hidden_layers * layer < 2.9e9 and 1.8e14 < flops < 2.1e14
    with pytest.raises(ValueError, match="prompt lengths"):
        theory.prefill_flops(config, [])


def test_mfu_against_a_known_gpu_and_a_clear_note_for_an_unknown_one():
    assert theory.peak_bf16_flops("NVIDIA H200") == 989e12
    assert theory.peak_bf16_flops("Mystery GPU") is None and theory.peak_bf16_flops(None) is None
    metrics = {"model_flops": 989e12 * 0.25, "wall_s": 0.5}
    assert analysis.prefill_mfu(metrics, "NVIDIA H200")["mfu"] == pytest.approx(0.5)
    unknown = analysis.prefill_mfu(metrics, "Mystery GPU")
    assert unknown["mfu"] is None and "unknown GPU 'Mystery GPU'" in unknown["mfu_note"]
    assert "PEAK_BF16_FLOPS" in unknown["mfu_note"]
    run = BenchRun("w2", environment={"gpu": "NVIDIA H200"})
    run.add(Measurement("prefill/3b/16x2048", "prefill", metrics=metrics))
    analysis.derive_all(run)
    assert run.get("prefill/3b/16x2048").derived["mfu"] == pytest.approx(0.5)


def test_bytes_limit_of_a_decode_step():
    kv = kv_bytes_per_token(28, 8, 128, 2)
    assert kv == 2 * 28 * 8 * 128 * 2
    assert decode_step_bytes(1000, kv, 256, 512.5) == 1000 + round(256 * 512.5 * kv)
    with pytest.raises(ValueError, match="batch >= 1"):
        decode_step_bytes(1000, kv, 0, 10)
    # 6e9 bytes of weights + 2 rows x 1000 tokens x 1e6 bytes = 8e9 bytes at 4e12 B/s: 2 ms;
    # a measured 4 ms step runs at half the limit
    metrics = {"ms_per_step": {"2": 4.0}, "context_tokens": {"2": 1000.0}, "weight_bytes": 6_000_000_000,
               "kv_bytes_per_token": 1_000_000}
    d = analysis.bytes_limits(metrics, 4e12)
    assert d["bytes_limit_ms"]["2"] == pytest.approx(2.0) and d["of_bytes_limit"] == pytest.approx(0.5)
    assert analysis.bytes_limits({"ms_per_step": {"2": 4.0}}, 4e12) == {}  # a record without the inputs


def test_the_rows_are_in_their_suites_and_chosen_by_only(capsys):
    table, owned = build_table(HarnessOptions(device="cpu"))
    assert {"batch/3b/b128", "batch/3b/b256"} <= set(owned["decode-speed"])
    assert "prefill/3b/16x2048" in owned["w2"] and set(ROWS) <= set(owned["all-gpu"])
    assert table["batch/3b/b256"].refs == {"bandwidth": "bandwidth"} and table["prefill/3b/16x2048"].kind == "prefill"
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    assert run_bench(parser.parse_args(["--suite", "all-gpu", "--only", "batch/3b/b*", "prefill/*", "--list"])) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["bandwidth", "batch/3b/b128", "batch/3b/b256", "prefill/3b/16x2048"]


def test_a_prefill_row_times_prompts_to_their_first_token_with_their_flops(ckpt_a):
    wl = Workload("p", 2, (8, 8), (1, 1))
    row = prefill_row("p/x", "two prompts", "g", wl, {"model": str(ckpt_a)})
    run = BenchRun("t", environment={"gpu": None})
    m = Harness(run, HarnessOptions(device="cpu", repeats=1, quiet=True)).run_rows(["p/x"], {"p/x": row})[0]
    assert m.ok, m.error
    _, config = load_model(ckpt_a, device="meta", load_format="dummy")
    assert m.metrics["model_flops"] == theory.prefill_flops(config, [8, 8]) and m.metrics["prompt_tokens"] == 16
    assert m.metrics["output_tokens"] == 2 and m.metrics["leaks"] == []
    assert m.derived["mfu"] is None and m.derived["mfu_note"].startswith("no GPU")
    with pytest.raises(ValueError, match="outputs of 1 token"):
        prefill_row("p/y", "decoding", "g", Workload("q", 2, (8, 8), (1, 4)), {"model": str(ckpt_a)})
