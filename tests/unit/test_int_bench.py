"""The int4 benchmark rows: where they sit in the table and what they compare with, the int4
roofline's bytes (codes, scales and offsets of the model as quantized at load), and a batch
sweep's speedup against its baseline sweep."""

from __future__ import annotations

import pytest
import torch

from infer_bench import suites
from infer_bench.analysis import batch_speedups
from infer_bench.rows import HarnessOptions
from infer.engine.step_costs import weight_bytes
from infer.models.loading.loader import load_model


def test_int4_rows_are_in_their_suites_with_their_references() -> None:
    table, owned = suites.build_table(HarnessOptions(device="cpu"))
    assert {"w1/3b/int4", "w1/8b/int4", "batch/3b-int4/b16", "w1/8b/ours"} <= set(owned["decode-speed"])
    assert {"costs/3b-1b-int4/graphs", "projection/3b-1b-int4"} <= set(owned["costs"])
    assert table["w1/3b/int4"].refs == {"roofline": "roofline/3b-int4", "baseline": "w1/3b/ours"}
    assert table["w1/8b/int4"].refs == {"roofline": "roofline/8b-int4", "baseline": "w1/8b/ours"}
    assert table["batch/3b-int4/b16"].refs["baseline"] == "batch/3b"
    assert all(ref in table for row in owned["decode-speed"] for ref in table[row].refs.values())


def test_the_int4_roofline_counts_the_bytes_it_stores() -> None:
    dense, config = load_model("dummy:llama-3.2-3b", dtype="bfloat16", device="meta")
    int4, _ = load_model("dummy:llama-3.2-3b", dtype="bfloat16", device="meta", quantization="int4")
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    n_k = [(config.q_size + 2 * config.kv_size, h), (h, config.q_size), (2 * i, h), (h, i)]
    codes = layers * sum(n * k // 2 + 2 * 2 * n * (k // 128) for n, k in n_k)  # codes; bf16 scales, offsets
    head = config.vocab_size * h + 2 * 2 * config.vocab_size * (h // 128)  # 8-bit codes, tied: the embedding's
    norms = 2 * h * (2 * layers + 1)
    assert weight_bytes(int4) == codes + head + norms
    assert 3.3 < weight_bytes(dense) / weight_bytes(int4) < 3.5
    assert next(int4.parameters()).dtype == torch.bfloat16


def test_a_sweep_against_its_baseline_sweep() -> None:
    ours = {"ms_per_step": {"16": 2.0}}
    base = {"ms_per_step": {"1": 2.0, "16": 3.0, "32": 5.0}}
    assert batch_speedups(ours, base) == {"speedup_by_batch": {"16": 1.5}, "speedup": 1.5}
    assert batch_speedups({"ms_per_step": {"64": 1.0}}, base) == {}


def test_integer_weights_route_to_the_gemv_and_never_the_triton_matmul() -> None:
    from infer.models.kernels.routes import GEMV, LIBRARY, MATMUL, ROUTES, check_routes, table_route
    for kind in ("int4", "int8"):
        for part in ("linear", "gate_up"):
            assert [table_route(kind, part, rows) for rows in (1, 2, 5, 16)] == [GEMV] * 4
            assert table_route(kind, part, 17) == LIBRARY
    bad = dict(ROUTES)
    bad[("int4", "gate_up")] = (GEMV, MATMUL, GEMV, GEMV, GEMV)
    with pytest.raises(ValueError, match="'gemv' or 'library'"):
        check_routes(bad)
