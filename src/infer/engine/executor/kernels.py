"""The kernels a runner's steps use: fused (torch.compile) or eager.

A model's fused bundle is its own (`model.compiled`), shared by every forward over it; on a
GPU it is compiled at start-up (`warm_chunks`, `warm_head`) so no request compiles mid-run.
"""

from __future__ import annotations

import logging
import time

import torch

from infer.engine.parts import ExecutionConfig
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.layers.attention import NoCacheView
from infer.models.llama import LlamaForCausalLM
from infer.models.medusa import MedusaHead

log = logging.getLogger("infer.engine")


def step_kernels(execution: ExecutionConfig, device: torch.device,
                 model: LlamaForCausalLM | EagleHead | MedusaHead) -> Kernels:
    """Fused kernels for every step of `model` (target, draft, EAGLE or Medusa heads) when
    `execution` asks for them, else EAGER; the model's own bundle, warmed at the first call
    on a GPU."""
    if not execution.compile_kernels:
        return EAGER
    compiled = model.compiled
    kernels = compiled.get()
    if not compiled.warmed and warms(model, next(model.parameters()).device.type):
        start = time.perf_counter()
        if isinstance(model, EagleHead):
            warm_head(model, kernels)
        else:
            warm_chunks(model, kernels)  # type: ignore[arg-type]
        compiled.warmed = True
        log.info("fused kernels of %s compiled for prefill chunks in %.1f s", type(model).__name__,
                 time.perf_counter() - start)
    return kernels


def warms(model: LlamaForCausalLM | EagleHead | MedusaHead, device_type: str) -> bool:
    """Whether `step_kernels` warms the model's bundle: an unsharded model or an EAGLE head on a
    GPU (a shard's forward all-reduces, so no rank may run one alone)."""
    if device_type != "cuda":
        return False
    return isinstance(model, EagleHead) or (isinstance(model, LlamaForCausalLM) and all(
        layer.parallel.world_size == 1 for layer in model.linears().values()))


def warm_chunks(model: LlamaForCausalLM, kernels: Kernels) -> None:
    """Forwards of a 3- and a 5-token chunk without a cache through `kernels`, so torch.compile
    builds its dynamic-width chunk variant now rather than at a first request."""
    device = next(model.parameters()).device
    capture, model.capture = model.capture, None  # (an EAGLE head's features: not from this forward)
    try:
        with torch.inference_mode():
            for width in (3, 5):
                model(torch.zeros((1, width), dtype=torch.long, device=device), kernels=kernels)
    finally:
        model.capture = capture


def warm_head(head: EagleHead, kernels: Kernels) -> None:
    """An EAGLE head's bundle compiled for its eager shapes: forward, features' combination and
    logits of 3 and 5 tokens (two widths make each token dimension dynamic)."""
    param = next(head.parameters())
    hidden = head.spec.hidden_size
    width = hidden if head.spec.method == "eagle" else 3 * head.spec.target_hidden_size  # (what `combine` reads)
    with torch.inference_mode():
        for n in (3, 5):
            ids = torch.zeros((1, n), dtype=torch.long, device=param.device)
            positions = torch.arange(n, device=param.device)[None]
            head(ids, torch.zeros((1, n, hidden), dtype=param.dtype, device=param.device), positions, NoCacheView(),
                 kernels)
            head.combine(torch.zeros((n, width), dtype=param.dtype, device=param.device), kernels)
            head.logits(torch.zeros((n, hidden), dtype=param.dtype, device=param.device), kernels)
