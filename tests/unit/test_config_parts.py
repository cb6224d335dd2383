"""The engine's resolved configuration (engine/parts.py, engine/defaults.py): each part
refuses its own bad combinations with a message naming the fix, the whole refuses what spans
parts, a resolved configuration is frozen, and resolving is deterministic and leaves the
user's EngineConfig as it was given."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.engine.config import EngineConfig
from infer.engine.defaults import resolve_config
from infer.engine.parts import (CacheConfig, ExecutionConfig, LoadConfig, ParallelConfig, ResolvedConfig,
                                SchedulerConfig, SpeculativeConfig)
from infer.speculative.ngram_tables import NgramConfig
from infer.speculative.node_tree import DynamicShape
from infer.speculative.suffix import SuffixConfig
from infer.speculative.tree import TreeShape

CPU = torch.device("cpu")


@pytest.mark.parametrize("build, message", [
    (lambda: LoadConfig("m", "m", torch.device("meta"), "auto"), "device must be a CPU or a CUDA device"),
    (lambda: LoadConfig("m", "m", CPU, "float8"), "dtype must be one of"),
    (lambda: LoadConfig("m", "m", CPU, "auto", quantization="int8"), "quantization must be None or 'fp8' or 'int4'"),
    (lambda: LoadConfig("m", "m", CPU, "auto", threads=0), r"threads must be >= 1 or None"),
    (lambda: LoadConfig("m", "m", CPU, "auto", draft_model="d", head="h"), "three ways to draft: load one"),
    (lambda: CacheConfig("paged", 0, 64), "max_batch_size must be >= 1"),
    (lambda: CacheConfig("paged", 2, 64, num_blocks=4, memory_bytes=1 << 20),
     "num_blocks and kv_cache_memory_bytes conflict"),
    (lambda: CacheConfig("contiguous", 2, 64, num_blocks=4), "apply to kv_cache_backend='paged' only"),
    (lambda: CacheConfig("contiguous", 2, 64, prefix_caching=True), "enable_prefix_caching=True requires"),
    (lambda: SchedulerConfig(4, 0), "max_num_batched_tokens must be >= 1"),
    (lambda: SchedulerConfig(4, 64, batching_mode="dynamic"), "batching_mode must be one of"),
    (lambda: SpeculativeConfig("draft_model", 0), "spec_length must be >= 1"),
    (lambda: SpeculativeConfig("draft_model", 2, TreeShape((2, 1)), policy="adaptive"),
     "spec_tree needs spec_policy='fixed'"),
    (lambda: SpeculativeConfig("draft_model", 3, TreeShape((2, 1))), "has depth 2 but spec_length is 3"),
    (lambda: SpeculativeConfig("ngram", 4, DynamicShape(8, 2, 4), ngram=NgramConfig()),
     "dynamic trees.*set speculative_method='draft_model' or 'suffix'"),
    (lambda: SpeculativeConfig("ngram", 4), r"'ngram' drafts from n-gram tables: give their settings"),
    (lambda: SpeculativeConfig("eagle", 4, ngram=NgramConfig()), "leave ngram unset"),
    (lambda: SpeculativeConfig("suffix", 8, DynamicShape(8, 2, 8)), "suffix decoding's settings"),
    (lambda: SpeculativeConfig("suffix", 4, TreeShape((2, 1, 1, 1)), suffix=SuffixConfig()), "grows its own trees"),
    (lambda: SpeculativeConfig("suffix", 8, DynamicShape(8, 2, 8), suffix=SuffixConfig(max_depth=8)),
     r"spec_suffix_max_depth \(8\) must exceed spec_length \(8\)"),
    (lambda: SpeculativeConfig("draft_model", 4, disable_batch_size=0), "spec_disable_batch_size must be >= 1"),
    (lambda: ParallelConfig(0), "tensor_parallel_size must be >= 1"),
    (lambda: ParallelConfig(1, all_reduce="one-shot"), "'one-shot' runs between CUDA devices"),
    (lambda: ParallelConfig(2, lm_head="rows"), "tensor_parallel_lm_head must be one of"),
    (lambda: ExecutionConfig(cuda_graph_sampling_batch_max=-1), "cuda_graph_sampling_batch_max must be >= 0"),
])
def test_each_part_refuses_its_own_bad_values_with_the_fix(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def _whole(**parts: Any) -> ResolvedConfig:
    values: dict[str, Any] = dict(load=LoadConfig("m", "m", CPU, "float32"), cache=CacheConfig("paged", 4, 64),
                                  scheduler=SchedulerConfig(4, 64, max_seq_len=64), speculative=None,
                                  parallel=ParallelConfig(), execution=ExecutionConfig())
    return ResolvedConfig(**{**values, **parts})


def test_the_whole_refuses_what_spans_its_parts() -> None:
    assert _whole().max_row_tokens == 1
    with pytest.raises(ValueError, match="use_cuda_graphs=True needs a CUDA device, but this engine runs on cpu"):
        _whole(execution=ExecutionConfig(use_cuda_graphs=True))
    with pytest.raises(ValueError, match="KV pools are sized for 4 sequences of 64 tokens but the scheduler runs 8"):
        _whole(scheduler=SchedulerConfig(8, 64, max_seq_len=64))
    with pytest.raises(ValueError, match="'one-shot' runs between CUDA devices"):
        _whole(parallel=ParallelConfig(2, all_reduce="one-shot"))
    chain = SpeculativeConfig("draft_model", 3)
    assert _whole(speculative=chain).max_row_tokens == 4  # g and K drafts
    with pytest.raises(ValueError, match="requires batching_mode='continuous'"):
        _whole(speculative=chain, scheduler=SchedulerConfig(4, 64, "static", 64))
    with pytest.raises(ValueError, match="dynamic trees run on one GPU: set tensor_parallel_size=1"):
        _whole(speculative=SpeculativeConfig("draft_model", 3, DynamicShape(8, 2, 3)), parallel=ParallelConfig(2))
    with pytest.raises(ValueError, match="speculative_method='eagle3' runs on one GPU"):
        _whole(speculative=SpeculativeConfig("eagle3", 3), parallel=ParallelConfig(2))


def test_engine_config_validates_through_the_parts_with_its_field_names() -> None:
    with pytest.raises(ValueError, match="^ngram_window must be an integer >= max_order"):
        EngineConfig(speculative_method="ngram", ngram_max_order=6, ngram_window=4)
    with pytest.raises(ValueError, match="^spec_suffix_max_depth must be an integer >= 2"):
        EngineConfig(speculative_method="suffix", spec_suffix_max_depth=1)
    with pytest.raises(ValueError, match="^spec_tree: tree shape must be comma-separated integers"):
        EngineConfig(spec_tree="3,x")
    assert EngineConfig(spec_tree="3, 2").spec_tree == "3,2"  # normalised
    assert EngineConfig(spec_tree="dynamic:16").speculative_part() == SpeculativeConfig(
        "draft_model", 5, DynamicShape(16, 4, 5))
    assert EngineConfig().speculative_part() is None
    assert EngineConfig(tensor_parallel_size=2, tensor_parallel_lm_head="replicated").parallel_part() == \
        ParallelConfig(2, lm_head="replicated")


def test_a_resolved_configuration_is_frozen_and_leaves_the_users_config_as_given(ckpt_a: Path) -> None:
    config = EngineConfig(model=str(ckpt_a), device="cpu", use_speculative_decoding=True, draft_model=str(ckpt_a),
                          spec_tree="2,1")
    given = dataclasses.replace(config)
    resolved = resolve_config(config)
    assert config == given and config.max_seq_len is None and config.max_batch_size is None
    assert resolved == resolve_config(config)  # deterministic
    assert (resolved.scheduler.max_seq_len, resolved.cache.max_seq_len) == (512, 512)  # the checkpoint's context
    assert resolved.load.dtype == "float32" and resolved.execution == ExecutionConfig()  # a CPU: eager, float32
    assert resolved.speculative is not None and resolved.speculative.tree == TreeShape((2, 1))
    assert resolved.max_row_tokens == 1 + 2 + 2  # g and the tree's nodes
    for part, name in ((resolved, "cache"), (resolved.cache, "max_seq_len"), (resolved.scheduler, "max_batch_size"),
                       (resolved.speculative, "length"), (resolved.execution, "use_cuda_graphs"),
                       (resolved.load, "seed"), (resolved.parallel, "size")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(part, name, getattr(part, name))


def test_the_load_part_names_what_loads_the_demo_filled_in(ckpt_a: Path) -> None:
    from infer.engine.loading import DEMO_DRAFT, DEMO_EAGLE3, DEMO_TARGET, load_part
    demo = load_part(EngineConfig(device="cpu", use_speculative_decoding=True))
    assert (demo.model, demo.tokenizer, demo.draft_model, demo.head) == (str(DEMO_TARGET), str(DEMO_TARGET),
                                                                          str(DEMO_DRAFT), None)
    assert demo.device == CPU and demo.dtype == "float32"  # "auto" on a CPU
    head = load_part(EngineConfig(device="cpu", speculative_method="eagle3"))
    assert (head.draft_model, head.head, head.medusa) == (None, str(DEMO_EAGLE3), None)
    mine = str(ckpt_a)
    given = load_part(EngineConfig(model=mine, tokenizer="tok", device="cpu", dtype="bfloat16",
                                   speculative_method="ngram", quantization="int4"))
    assert (given.model, given.tokenizer, given.dtype, given.quantization) == (mine, "tok", "bfloat16", "int4")
    assert (given.draft_model, given.head, given.medusa) == (None, None, None)  # n-gram tables load no files
    medusa = load_part(EngineConfig(model=mine, device="cpu", speculative_method="medusa", draft_model="dummy-medusa:x",
                                    spec_length=2))
    assert (medusa.medusa, medusa.draft_model) == ("dummy-medusa:x", None)
    assert resolve_config(EngineConfig(model=mine, device="cpu", use_speculative_decoding=True,
                                       draft_model=mine)).load == load_part(
        EngineConfig(model=mine, device="cpu", use_speculative_decoding=True, draft_model=mine))
