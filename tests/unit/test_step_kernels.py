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


def test_an_eagle_head_is_warmed_for_its_eager_shapes(ckpt_a: Path, tmp_path: Path) -> None:
    from helpers.eagle_heads import write_head

    from infer.engine.executor.kernels import warm_head
    from infer.models.loading.eagle_files import load_eagle_head

    target, _ = load_model(str(ckpt_a), device="cpu")
    head = load_eagle_head(str(write_head(tmp_path / "eagle3", ckpt_a, "eagle3", draft_vocab=120,
                                          aux_layers=[0, 1, 1])), "eagle3", target)
    assert warms(head, "cuda") and not warms(head, "cpu")
    shapes = []

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return EAGER.rmsnorm(x, weight, eps)

    def norm_linear(layer, x, weight, eps):
        shapes.append(("logits", x.shape[0]))
        return EAGER.norm_linear(layer, x, weight, eps)

    warm_head(head, replace(EAGER, rmsnorm=rmsnorm, norm_linear=norm_linear))
    hidden = head.spec.hidden_size
    # the forward's two norms at 3 and 5 tokens, the logits at 3 and 5 rows
    assert {(1, 3, hidden), (1, 5, hidden), ("logits", 3), ("logits", 5)} <= set(shapes)
