"""Measure the step costs the adaptive speculation policy needs (run once at start-up).

c = the time one more draft token adds to a draft round / plain target step time, and
v(K) = target verification time for K+1 tokens / plain target step time, for batch sizes
1, 2, 4, ... max_batch_size. c is the slope between whole draft rounds of 1 and K_max
greedy tokens (`draft_loop`: on the GPU one graph replay each, so a round's host work counts
once, as in real rounds; a lone draft step would price each token with a launch's host
overhead, several times its GPU time for small drafts). The forwards are the engine's own
(CUDA graphs when enabled), run on scratch slots that are freed afterwards. Batch sizes
whose scratch slots do not fit the KV pools (a small num_blocks) are not measured; the
policy uses the nearest measured one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from infer.cache.forward import ForwardFn
from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.spec.costs import CostModel


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls, each timed alone up to a device sync (as real steps
    end in one): a mean of back-to-back calls let one slow call (the host preempted, a
    collection) move an instance's costs by a quarter, and whether it speculates with them."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class PoolTooSmall(RuntimeError):
    """The KV pool cannot hold the scratch slots of this calibration batch."""


def _on_scratch(pool: CachePoolProtocol, batch: int, context: int, width: int,
                run: Callable[[BatchLayout], object], repeats: int) -> float:
    """Seconds per `run(layout)` writing `width` new tokens after `context` cached ones in
    `batch` scratch slots (truncated back after each call, freed at the end)."""
    device = pool.k_cache.device
    slots: list[int] = []
    try:
        for _ in range(batch):
            if not pool.can_allocate(context + width):
                raise PoolTooSmall(f"no room for {batch} scratch slots of {context + width} tokens")
            slots.append(pool.allocate_slot(context + width))
        layout = BatchLayout.of(slots, [context] * batch, [width] * batch)

        def once() -> None:
            for s in slots:  # (paged truncation below frees the blocks past the context)
                if not pool.ensure_capacity(s, context + width):
                    raise RuntimeError("KV pool too small to calibrate speculation costs")
            run(layout)
            for s in slots:
                pool.truncate_to(s, context)

        with torch.inference_mode():
            return _time(once, device, repeats)
    finally:
        for s in slots:
            pool.free_slot(s)


def forward_time(forward: ForwardFn, pool: CachePoolProtocol, vocab_size: int, batch: int, width: int,
                 all_logits: bool, repeats: int = 9, context: int = 32) -> float:
    """Seconds per forward of `width` new tokens after `context` cached ones, `batch` rows."""
    ids = torch.randint(0, vocab_size, (batch, width))
    return _on_scratch(pool, batch, context, width, lambda layout: forward(ids, layout, all_logits), repeats)


def draft_round_time(draft: ForwardFn, pool: CachePoolProtocol, vocab_size: int, batch: int, k: int,
                     repeats: int = 9, context: int = 32) -> float:
    """Seconds per draft round of k greedy tokens (`draft_loop`), `batch` rows. Greedy rounds
    are the cheaper kind (no sampling kernels): the policy asks whether speculating could
    pay at an optimistic acceptance, and real rounds' measured costs replace this soon."""
    ids = torch.randint(0, vocab_size, (batch, 1))
    uniforms = torch.full((batch, k), 0.5, dtype=torch.float64)

    def run(layout: BatchLayout) -> None:
        tokens, _ = draft.draft_loop(ids, layout, k, [1.0] * batch, uniforms, [True] * batch)
        tokens.tolist()  # a round ends in a host sync

    return _on_scratch(pool, batch, context, k, run, repeats)


def draft_token_time(draft: ForwardFn, pool: CachePoolProtocol, vocab_size: int, batch: int, k_max: int,
                     repeats: int = 9) -> float:
    """Seconds one more draft token adds to a round: the slope between rounds of 1 and k_max
    tokens (a lone round's time when k_max is 1)."""
    one = draft_round_time(draft, pool, vocab_size, batch, 1, repeats)
    if k_max == 1:
        return one
    return max(0.0, draft_round_time(draft, pool, vocab_size, batch, k_max, repeats) - one) / (k_max - 1)


def measure_costs(target: ForwardFn, target_pool: CachePoolProtocol, draft: ForwardFn | None,
                  draft_pool: CachePoolProtocol | None, vocab_size: int, max_batch_size: int, k_max: int,
                  repeats: int = 9) -> CostModel:
    model = CostModel(k_max)
    batch = 1
    while True:
        try:
            plain = forward_time(target, target_pool, vocab_size, batch, 1, False, repeats)
            verify = [1.0] + [forward_time(target, target_pool, vocab_size, batch, k + 1, True, repeats) / plain
                              for k in range(1, k_max + 1)]
            draft_ratio = (draft_token_time(draft, draft_pool, vocab_size, batch, k_max, repeats) / plain
                           if draft is not None and draft_pool is not None else 0.0)
        except PoolTooSmall:
            return model  # larger batches use the largest measured one (no measurement: defaults)
        model.verify_ratio[batch], model.draft_ratio[batch] = verify, draft_ratio
        model.forward_seconds[batch] = plain
        if batch >= max_batch_size:
            return model
        batch = min(batch * 2, max_batch_size)
