"""The kernels a runner's steps use: fused (torch.compile) or eager.

A model's fused bundle is its own (`model.compiled`, models/kernels/bundle.py), so every
forward function over it shares the compiled variants. On a GPU it is compiled at start-up
(`warm_chunks`, timed at INFO): for chunks of any width once, the decode shapes as its
CUDA graphs are captured; an EAGLE head's for any number of tokens and rows (`warm_head`:
its eager rounds, catch-ups and verification feeds then never compile mid-run).
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
    """Fused (torch.compile) kernels for every step of `model` (the target, a draft model,
    an EAGLE head's rounds or Medusa heads; prefill chunks too: the bundle is compiled for
    dynamic shapes) when the resolved execution part asks for them (by default with CUDA
    graphs on a GPU: `engine/defaults.py`). The bundle is the
    model's own (`model.compiled`): a head's apart from its target's, one model's the same
    at every call. On a GPU an unsharded model's bundle is compiled for multi-token chunks
    at its first call here (`warm_chunks`), not at the first prompt."""
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
    """Whether `step_kernels` warms the model's bundle: a whole (unsharded) model or an EAGLE
    head (one GPU) on a GPU.
    A tensor-parallel shard's forward all-reduces, so no rank may run one alone; its bundle
    compiles at the first prompt, on every rank together."""
    if device_type != "cuda":
        return False
    return isinstance(model, EagleHead) or (isinstance(model, LlamaForCausalLM) and all(
        layer.parallel.world_size == 1 for layer in model.linears().values()))


def warm_chunks(model: LlamaForCausalLM, kernels: Kernels) -> None:
    """Forwards of a 3- and a 5-token chunk without a cache through `kernels`: torch.compile
    builds its variant for chunks of one row and any number of tokens (a prefill's packed
    layout; the second width makes that dimension dynamic) now, where it costs start-up
    time instead of a first request's latency."""
    device = next(model.parameters()).device
    capture, model.capture = model.capture, None  # (an EAGLE head's features: not from this forward)
    try:
        with torch.inference_mode():
            for width in (3, 5):
                model(torch.zeros((1, width), dtype=torch.long, device=device), kernels=kernels)
    finally:
        model.capture = capture


def warm_head(head: EagleHead, kernels: Kernels) -> None:
    """An EAGLE head's bundle compiled for its eager shapes: forwards of 3 and 5 tokens without
    a cache, then the features' combination and the logits of 3 and 5 rows (two widths make
    each token dimension dynamic; one row takes the GEMV route)."""
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
