"""Sizing defaults (engine/batch_size.py): the context length defaults to the model's own,
cut to what the KV memory holds (a GPU's memory beside the weights, CPU_KV_BYTES on a CPU,
or a given pool); max_batch_size from memory on a GPU, 8 on a CPU; the paged pool cut to the
memory (never below one sequence); a given size kept. The byte estimate is checked against a
loaded model's real weights."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from infer.engine.batch_size import (BATCH_SIZING_TOKENS, CPU_DEFAULT, CPU_KV_BYTES, GPU_MAX, MEMORY_SHARE,
                                     RESERVE_BYTES, engine_sizes, model_bytes, plan_sizes)
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.step_costs import weight_bytes
from infer.models.config import ModelConfig
from infer.models.loading.loader import load_model, read_model_config


@pytest.mark.parametrize("shape", ["dummy:llama-3.2-1b", "dummy:llama-3.2-3b"])
def test_weight_estimate_is_the_models_parameters(shape: str) -> None:
    config = read_model_config(shape, "dummy")
    model = load_model(shape, dtype="bfloat16", device="meta", load_format="dummy")[0]
    assert model_bytes(config, 2).weights == pytest.approx(weight_bytes(model), rel=1e-3)
    kv = model_bytes(config, 2).kv_per_token
    assert kv == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert model_bytes(config, 2, ranks=2).kv_per_token == kv // 2


SHAPE_3B = read_model_config("dummy:llama-3.2-3b", "dummy")  # 131,072 positions, 112 KiB of bf16 KV a token
H200 = 141 << 30


def _capacity(device_bytes: int | None, configs: list[ModelConfig], element: int) -> int:
    sizes = [model_bytes(c, element) for c in configs]
    budget = CPU_KV_BYTES if device_bytes is None else int(MEMORY_SHARE * device_bytes - sum(
        s.weights for s in sizes) - RESERVE_BYTES)
    return budget // sum(s.kv_per_token for s in sizes)


def test_a_gpu_batch_fits_the_memory_left_beside_the_weights() -> None:
    config = EngineConfig(model="dummy:llama-3.2-3b", max_seq_len=512)  # (below BATCH_SIZING_TOKENS)
    model = model_bytes(SHAPE_3B, 2)
    device = 16 << 30
    n = plan_sizes(config, [SHAPE_3B], device, 2).max_batch_size
    budget = MEMORY_SHARE * device - model.weights - RESERVE_BYTES
    assert 1 < n < GPU_MAX and n * 512 * model.kv_per_token <= budget < (n + 1) * 512 * model.kv_per_token
    assert plan_sizes(config, [SHAPE_3B], H200, 2).max_batch_size == GPU_MAX  # capped
    tight = int((model.weights + RESERVE_BYTES + 100 * model.kv_per_token) / MEMORY_SHARE)  # 100 tokens of KV
    assert plan_sizes(config, [SHAPE_3B], tight, 2).max_batch_size == 1  # at least one sequence
    draft = read_model_config("dummy:llama-3.2-1b", "dummy")
    assert plan_sizes(config, [SHAPE_3B, draft], device, 2).max_batch_size < n  # a draft's KV counts too


def test_a_gpu_serves_the_models_whole_context_and_shares_the_pool() -> None:
    capacity = _capacity(H200, [SHAPE_3B], 2)
    sizes = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b"), [SHAPE_3B], H200, 2)
    assert capacity > SHAPE_3B.max_position_embeddings  # (the memory holds several whole sequences)
    assert sizes.max_seq_len == SHAPE_3B.max_position_embeddings == 131072
    assert sizes.max_batch_size == min(GPU_MAX, capacity // BATCH_SIZING_TOKENS) == GPU_MAX
    assert sizes.num_blocks == -(-capacity // 16)  # the memory, shared
    small = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b"), [SHAPE_3B], 24 << 30, 2)
    assert small.max_seq_len == _capacity(24 << 30, [SHAPE_3B], 2) < 131072  # cut to what the memory holds
    # a given max_seq_len keeps the old rule: the pool is batch x max_seq_len when it fits
    given = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b", max_seq_len=1024), [SHAPE_3B], H200, 2)
    assert (given.max_seq_len, given.max_batch_size, given.num_blocks) == (1024, GPU_MAX, None)


def test_a_cpu_context_is_cut_to_its_kv_budget_and_the_pool_never_grows_past_it() -> None:
    capacity = _capacity(None, [SHAPE_3B], 4)  # float32 on a CPU
    sizes = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b", device="cpu"), [SHAPE_3B], None, 4)
    assert sizes.max_seq_len == capacity < 131072 and sizes.max_batch_size == CPU_DEFAULT
    assert sizes.num_blocks == -(-capacity // 16)  # the budget, not 8 whole sequences
    # a given context longer than the budget still gets a pool of one whole sequence
    long = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b", device="cpu", max_seq_len=65536), [SHAPE_3B], None, 4)
    assert long.max_seq_len == 65536 and long.num_blocks == 65536 // 16
    # a given pool is the budget; the contiguous backend reserves the context for every slot
    pool = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b", num_blocks=100), [SHAPE_3B], None, 4)
    assert pool.max_seq_len == 1600 and pool.num_blocks is None
    slots = plan_sizes(EngineConfig(model="dummy:llama-3.2-3b", kv_cache_backend="contiguous", max_batch_size=4),
                       [SHAPE_3B], None, 4)
    assert slots.max_seq_len == capacity // 4 and slots.num_blocks is None


def test_the_context_is_the_least_of_the_models_and_the_sliding_window() -> None:
    draft = replace(SHAPE_3B, max_position_embeddings=2048)
    assert plan_sizes(EngineConfig(), [SHAPE_3B, draft], H200, 2).max_seq_len == 2048
    windowed = replace(SHAPE_3B, sliding_window=4096)
    assert plan_sizes(EngineConfig(), [windowed], H200, 2).max_seq_len == 4096
    assert plan_sizes(EngineConfig(max_seq_len=8192), [windowed], H200, 2).max_seq_len == 8192  # (refused at load)
    assert plan_sizes(EngineConfig(max_seq_len=200_000), [SHAPE_3B], H200, 2).max_seq_len == 131072  # cut


def test_weights_that_leave_no_kv_memory_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="too few for a sequence. Set max_seq_len and kv_cache_memory_bytes"):
        plan_sizes(EngineConfig(), [SHAPE_3B], 8 << 30, 2)


def test_cpu_engines_default_to_eight_and_the_models_context(ckpt_a: Path) -> None:
    cpu = torch.device("cpu")
    sizes = engine_sizes(EngineConfig(model=str(ckpt_a), device="cpu"), cpu)
    assert (sizes.max_batch_size, sizes.max_seq_len) == (CPU_DEFAULT, 512)  # the checkpoint's context
    given = engine_sizes(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=3, max_seq_len=64), cpu)
    assert (given.max_batch_size, given.max_seq_len, given.num_blocks) == (3, 64, None)
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=64))
    assert engine.config.max_batch_size is None  # (as given: the engine's resolved parts hold the size)
    assert engine.resolved.scheduler.max_batch_size == CPU_DEFAULT == engine.resolved.cache.max_batch_size
    with pytest.raises(ValueError, match="max_batch_size must be >= 1 or None"):
        EngineConfig(max_batch_size=0)
