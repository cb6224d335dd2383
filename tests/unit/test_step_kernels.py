"""The kernel bundle's warm-up: a forward of a short chunk without a cache, which leaves
the model's EAGLE feature capture as it found it, for whole models on a GPU only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from infer.engine.executor.kernels import warm_chunks, warms
from infer.models.capture import HiddenCapture
from infer.models.kernels.bundle import EAGER
from infer.models.layers.parallel import Parallel
from infer.models.loading.loader import load_model


def test_warm_chunks_runs_two_chunk_widths_and_keeps_the_capture(ckpt_a: Path) -> None:
    model, _ = load_model(str(ckpt_a), device="cpu")
    capture = HiddenCapture((0, 1))
    model.capture = capture
    shapes = []

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shapes.append(tuple(x.shape[:2]))
        return EAGER.rmsnorm(x, weight, eps)

    warm_chunks(model, replace(EAGER, rmsnorm=rmsnorm))
    assert set(shapes) == {(1, 3), (1, 5)}  # the bundle served one-row chunks of two widths
    assert model.capture is capture and capture.last is None  # no features stored from the warm-up


def test_only_a_whole_model_on_a_gpu_is_warmed(ckpt_a: Path) -> None:
    model, _ = load_model(str(ckpt_a), device="cpu")
    assert warms(model, "cuda") and not warms(model, "cpu")
    model.model.layers[0].mlp.down_proj.parallel = Parallel("row", 0, 2)  # a tensor-parallel shard
    assert not warms(model, "cuda")  # its forward all-reduces: never run by one rank alone
