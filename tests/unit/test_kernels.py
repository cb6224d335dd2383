"""Kernel bundles: each model owns its compiled bundle, shared by every forward function
over it and dropped with it (no compile on the CPU here: bundles are made, never run;
tests/gpu checks that compiled kernels match the eager ones)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from infer.engine.config import EngineConfig
from infer.engine.parts import ExecutionConfig
from infer.engine.engine import Engine
from infer.engine.executor.kernels import step_kernels
from infer.models.kernels.bundle import EAGER, CompiledKernels, compiled_kernels
from infer.models.loading.loader import load_model

COMPILED = ExecutionConfig(compile_kernels=True)
CPU = torch.device("cpu")


def _code(fn):
    return getattr(fn, "_torchdynamo_orig_callable", fn).__code__


def test_every_compiled_bundle_has_its_own_code_objects():
    a, b = compiled_kernels(), compiled_kernels()
    # separate code objects: separate torch.compile caches and recompile limits per model
    assert _code(a.rmsnorm) is not _code(b.rmsnorm)
    assert _code(a.rmsnorm).co_code == _code(b.rmsnorm).co_code
    owned = CompiledKernels()
    assert owned.get() is owned.get() and not owned.warmed  # made once, at its first use


def test_two_models_of_one_shape_keep_separate_bundles_each_dropped_with_its_model(ckpt_a: Path):
    first, second = (load_model(str(ckpt_a), device="cpu")[0] for _ in range(2))
    kernels = step_kernels(COMPILED, CPU, first)
    assert kernels.name == "fused" and kernels is first.compiled.get()
    assert step_kernels(COMPILED, CPU, first) is kernels  # every forward function over it: one bundle
    assert step_kernels(COMPILED, CPU, second) is not kernels
    assert step_kernels(ExecutionConfig(), CPU, second) is EAGER  # not asked for: eager
    dropped = weakref.ref(kernels)
    del first, kernels
    gc.collect()
    assert dropped() is None


def test_engines_over_the_same_models_share_their_bundle_and_others_do_not(ckpt_a: Path):
    config = EngineConfig(model=str(ckpt_a), device="cpu", compile_kernels=True, max_seq_len=64, max_batch_size=2)
    first = Engine(config)
    kernels = first.runner.kernels
    assert kernels.name == "fused" and kernels is first.models.target.compiled.get()
    assert Engine(config, first.models).runner.kernels is kernels  # (a benchmark's engines over loaded models)
    assert Engine(config).runner.kernels is not kernels  # models of its own, a bundle of its own
