"""Peer runner: Hugging Face transformers `generate` on the same weights, in the same process.

The HF model is built from our loader's config and weights, so it runs exactly our engine's
weights. `run_hf` times plain, assisted (a draft model) or prompt-lookup generation with
fixed lengths, a streamer timing each token for TTFT and decode tokens/s. A failing peer
raises; the suite records the error. docs/benchmarks.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from infer_bench.engine_runner import default_dtype, free_memory, primary_rate, request_metrics
from infer.timing import synchronize
from infer_bench.workloads import Workload, build_requests
from infer.engine.loading import load_tokenizer, resolve_device
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.loader import load_model


@dataclass(frozen=True)
class HFPeer:
    """Which HF generation to time. `assistant` is a model name/path (assisted generation);
    `prompt_lookup` the number of tokens prompt-lookup decoding proposes."""

    model: str
    assistant: str | None = None
    prompt_lookup: int | None = None
    load_format: str = "auto"
    cache_implementation: str | None = None  # e.g. "static" (transformers compiles the step)

    def __post_init__(self) -> None:
        if self.assistant is not None and self.prompt_lookup is not None:
            raise ValueError("HFPeer: choose assistant or prompt_lookup, not both")
        if self.prompt_lookup is not None and self.prompt_lookup < 1:
            raise ValueError(f"HFPeer: prompt_lookup must be >= 1, got {self.prompt_lookup}")

    @property
    def method(self) -> str:
        if self.assistant is not None:
            return "assisted"
        return "prompt_lookup" if self.prompt_lookup is not None else "plain"


def hf_model_from_ours(ours: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding a copy of `ours`'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    config = LlamaConfig(**ours.config.to_hf_dict())
    with torch.device(device):
        try:
            hf = HFLlama._from_config(config, dtype=dtype)
        except TypeError:  # older transformers name
            hf = HFLlama._from_config(config, torch_dtype=dtype)
    hf = hf.to(device=device, dtype=dtype)
    state = {name: t.to(device=device, dtype=dtype) for name, t in ours.hf_state_dict()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    bad = [m for m in missing if m not in allowed and "rotary" not in m]
    if bad or unexpected:
        raise RuntimeError(f"HF weight copy mismatch: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval().requires_grad_(False)


def load_hf(name: str, load_format: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    ours, _ = load_model(name, dtype=dtype, device=device, load_format=load_format)
    try:
        return hf_model_from_ours(ours, device, dtype)
    finally:
        del ours
        free_memory()


class _ArrivalTimes:
    """A minimal streamer: the time of each `put` (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def generate_kwargs(workload: Workload, max_new: int, pad_id: int, peer: HFPeer) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
    if workload.temperature > 0:
        kwargs.update(do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if peer.prompt_lookup is not None:
        kwargs["prompt_lookup_num_tokens"] = peer.prompt_lookup
    if peer.cache_implementation is not None:
        kwargs["cache_implementation"] = peer.cache_implementation
    return kwargs


def _generate(hf: torch.nn.Module, ids: torch.Tensor, kwargs: Mapping[str, Any],
              assistant: torch.nn.Module | None) -> tuple[torch.Tensor, list[float]]:
    streamer = _ArrivalTimes()
    extra = {"assistant_model": assistant} if assistant is not None else {}
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, streamer=streamer, **kwargs, **extra)
    return out, streamer.times[1:]


@dataclass
class TimedRequest:
    """Stand-in for a Request in `request_metrics`."""

    output_token_ids: list[int]
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None


def run_hf(workload: Workload, peer: HFPeer, *, device: str = "auto", warmup_tokens: int | None = None
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time HF generate on every request of `workload`, one after another; (params, metrics)."""
    dev = resolve_device(device)
    dtype = getattr(torch, default_dtype(dev))
    import transformers
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # deprecation chatter about fixed-length kwargs
    hf = load_hf(peer.model, peer.load_format, dev, dtype)
    assistant = load_hf(peer.assistant, peer.load_format, dev, dtype) if peer.assistant else None
    try:
        tokenizer = load_tokenizer(peer.model)
        prompts = build_requests(workload, hf.config.vocab_size, tokenizer)
        pad = hf.config.eos_token_id
        pad_id = int(pad[0] if isinstance(pad, list) else (pad if pad is not None else 0))
        first = torch.tensor([prompts.requests[0].prompt_ids], device=dev)
        # full length by default: the dynamic cache meets every context length once (per-shape
        # kernel plans), a static cache is sized by prompt + max_new_tokens (and compiled)
        full = prompts.requests[0].max_tokens
        warm = full if warmup_tokens is None or peer.cache_implementation == "static" else min(warmup_tokens, full)
        if warm > 0:
            torch.manual_seed(workload.seed + 1)
            _generate(hf, first, generate_kwargs(workload, warm, pad_id, peer), assistant)
        timed, wall = _timed_requests(hf, assistant, workload, prompts.requests, pad_id, peer, dev)
        metrics = request_metrics(timed, wall)
        metrics.update(expected_output_tokens=prompts.expected_output_tokens)
        metrics["primary_rate"] = primary_rate(metrics, workload.num_requests)
        params = {"workload": workload.to_dict(), "prompt_source": prompts.source, "peer": "transformers",
                  "transformers": transformers.__version__, "method": peer.method, "model": peer.model,
                  "assistant": peer.assistant, "prompt_lookup_num_tokens": peer.prompt_lookup,
                  "cache_implementation": peer.cache_implementation, "dtype": str(dtype)}
        return params, metrics
    finally:
        del hf, assistant
        free_memory()
        hf_logging.set_verbosity(verbosity)


def _timed_requests(hf: torch.nn.Module, assistant: torch.nn.Module | None, workload: Workload, requests: list,
                    pad_id: int, peer: HFPeer, dev: torch.device) -> tuple[list[TimedRequest], float]:
    timed: list[TimedRequest] = []
    synchronize(dev)
    start = time.perf_counter()
    for i, spec in enumerate(requests):
        ids = torch.tensor([spec.prompt_ids], device=dev)
        torch.manual_seed(workload.seed * 100_003 + i)
        arrival = time.perf_counter()
        out, arrivals = _generate(hf, ids, generate_kwargs(workload, spec.max_tokens, pad_id, peer), assistant)
        synchronize(dev)
        new = out[0, ids.shape[1]:].tolist()
        timed.append(TimedRequest(new, arrival, arrivals[0] if arrivals else None, time.perf_counter()))
    return timed, time.perf_counter() - start
