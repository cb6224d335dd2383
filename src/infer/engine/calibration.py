"""Measure the step costs the adaptive speculation policy needs (run once at start-up).

c = draft step time / plain target step time, and v(K) = target time for K+1 tokens /
plain target step time, for batch sizes 1, 2, 4, ... max_batch_size. Forwards run on
scratch slots that are freed afterwards; nothing is committed to any cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.models.llama import LlamaForCausalLM
from infer.spec.policy import CostModel


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def _forward_time(model: LlamaForCausalLM, pool: CachePoolProtocol, batch: int, width: int,
                  repeats: int) -> float:
    device = next(model.parameters()).device
    slots = [pool.allocate_slot(width) for _ in range(batch)]
    try:
        for s in slots:
            pool.ensure_capacity(s, width)
        layout = BatchLayout.of(slots, [0] * batch, [width] * batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, width), device=device)
        positions = layout.positions(device)

        def run() -> None:
            model(ids, positions, pool.view(layout))

        with torch.inference_mode():
            return _time(run, device, repeats)
    finally:
        for s in slots:
            pool.free_slot(s)


def measure_costs(target: LlamaForCausalLM, target_pool: CachePoolProtocol, draft: LlamaForCausalLM | None,
                  draft_pool: CachePoolProtocol | None, max_batch_size: int, k_max: int,
                  repeats: int = 3) -> CostModel:
    model = CostModel(k_max)
    batch = 1
    while True:
        plain = _forward_time(target, target_pool, batch, 1, repeats)
        model.verify_ratio[batch] = [1.0] + [
            _forward_time(target, target_pool, batch, k + 1, repeats) / plain for k in range(1, k_max + 1)]
        model.draft_ratio[batch] = (_forward_time(draft, draft_pool, batch, 1, repeats) / plain
                                    if draft is not None and draft_pool is not None else 0.0)
        if batch >= max_batch_size:
            return model
        batch = min(batch * 2, max_batch_size)
