"""The default max_batch_size: sized from device memory on a GPU (the byte estimate checked
against a loaded model's real weights), 8 on a CPU, a given size kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from infer.engine.batch_size import (CPU_DEFAULT, GPU_MAX, MEMORY_SHARE, RESERVE_BYTES, ModelBytes,
                                     fitting_batch_size, model_bytes, resolve_max_batch_size)
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.step_costs import weight_bytes
from infer.models.loader import load_model, read_model_config


@pytest.mark.parametrize("shape", ["dummy:llama-3.2-1b", "dummy:llama-3.2-3b"])
def test_weight_estimate_is_the_models_parameters(shape: str) -> None:
    config = read_model_config(shape, "dummy")
    model = load_model(shape, dtype="bfloat16", device="meta", load_format="dummy")[0]
    assert model_bytes(config, 2).weights == pytest.approx(weight_bytes(model), rel=1e-3)
    kv = model_bytes(config, 2).kv_per_token
    assert kv == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert model_bytes(config, 2, ranks=2).kv_per_token == kv // 2


def test_batch_fits_the_memory_left_beside_the_weights() -> None:
    model = ModelBytes(weights=6 << 30, kv_per_token=100_000)
    device = 80 << 30
    n = fitting_batch_size([model], device, 4096)
    budget = MEMORY_SHARE * device - model.weights - RESERVE_BYTES
    assert n * 4096 * model.kv_per_token <= budget < (n + 1) * 4096 * model.kv_per_token
    assert fitting_batch_size([model], 1 << 40, 1024) == GPU_MAX  # capped
    assert fitting_batch_size([model], 8 << 30, 4096) == 1  # at least one sequence
    two = fitting_batch_size([model, ModelBytes(1 << 30, 50_000)], device, 4096)  # a draft's KV counts too
    assert two < n


def test_cpu_engines_default_to_eight_and_a_given_size_is_kept(ckpt_a: Path) -> None:
    assert resolve_max_batch_size(EngineConfig(model=str(ckpt_a), device="cpu")) == CPU_DEFAULT
    assert resolve_max_batch_size(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=3)) == 3
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=64))
    assert engine.config.max_batch_size == CPU_DEFAULT == engine.scheduler.config.max_batch_size
    with pytest.raises(ValueError, match="max_batch_size must be >= 1 or None"):
        EngineConfig(max_batch_size=0)
