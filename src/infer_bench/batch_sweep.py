"""Decode step time against batch size, on one engine (`infer bench` kind "batch_sweep").

For each batch size B, B requests past their prefill, `steps` timed decode steps, then
aborted. Recorded beside the times for the bytes limit (bench/roofline.py): the weight
bytes, the KV bytes a token and per B the mean context of the timed steps.
"""

from __future__ import annotations

import time
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer.engine.batch_size import kv_bytes_per_token
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.step_costs import weight_bytes
from infer.sampling import SamplingParams
from infer.timing import synchronize


def batch_sweep(overrides: Mapping[str, Any], batches: Sequence[int], prompt_len: int = 128,
                steps: int = 32, device: str = "auto") -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, metrics) of decode steps at each batch size in `batches`."""
    if not batches or min(batches) < 1 or steps < 1:
        raise ValueError("batch_sweep needs batch sizes >= 1 and steps >= 1")
    base = EngineConfig.from_kwargs(**{"device": device, "max_batch_size": max(batches), **overrides})
    most = max(batches)  # decode rows take their tokens of a step first, prompts the rest
    prefill_steps = -(-most * prompt_len // max(1, base.max_num_batched_tokens - most)) + 1
    max_len = prompt_len + 2 * steps + 32 + prefill_steps
    config = EngineConfig.from_kwargs(**{"device": device, "max_batch_size": max(batches),
                                         "max_seq_len": max_len, **overrides})
    engine = Engine(config)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=max_len - prompt_len - 1, ignore_eos=True)
    ms: dict[str, float] = {}
    context: dict[str, float] = {}
    try:
        for b in batches:
            requests = [engine.add_request(torch.randint(0, engine.vocab_size, (prompt_len,), generator=gen).tolist(),
                                           params) for _ in range(b)]
            while any(r.num_computed_tokens < prompt_len for r in requests):
                engine.step()
            for _ in range(4):  # warm: every request decoding, graphs of this bucket replayed once
                engine.step()
            synchronize(engine.device)
            first = statistics.fmean(r.num_computed_tokens for r in requests)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            synchronize(engine.device)
            ms[str(b)] = (time.perf_counter() - start) / steps * 1e3
            context[str(b)] = (first + statistics.fmean(r.num_computed_tokens for r in requests)) / 2
            if any(r.is_finished for r in requests):
                raise RuntimeError(f"batch {b}: requests finished before the timed steps ended (prefill took "
                                   "longer than planned): raise max_num_batched_tokens")
            for r in requests:
                engine.abort(r.request_id)
            while engine.has_unfinished():
                engine.step()
        leaks = engine.leak_report()
        weights = weight_bytes(engine.models.target)
        k_cache = engine.runner.cache_pool.k_cache  # [L, rows, Hkv, D]
        kv_token = kv_bytes_per_token(k_cache.shape[0], k_cache.shape[2], k_cache.shape[3], k_cache.element_size())
    finally:
        engine.close()  # (tensor parallelism: its workers end now)
        del engine
    one = ms[str(min(batches))]
    metrics = {"ms_per_step": ms, "tokens_per_s": {b: int(b) / v * 1e3 for b, v in ms.items()},
               "step_vs_batch1": {b: v / one for b, v in ms.items()}, "context_tokens": context,
               "weight_bytes": weights, "kv_bytes_per_token": kv_token, "leaks": leaks}
    return ({"overrides": dict(overrides), "batches": list(batches), "prompt_len": prompt_len, "steps": steps,
             "max_seq_len": max_len, "max_num_batched_tokens": config.max_num_batched_tokens}, metrics)
