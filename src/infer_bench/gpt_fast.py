"""Peer runner: gpt-fast's compiled decode on a model shape, from a checkout the user gives.

gpt-fast (github.com/pytorch-labs/gpt-fast) shows how fast plain PyTorch decodes at batch
1: its `Transformer` with a static KV cache and `decode_one_token` under
`torch.compile(mode="reduce-overhead", fullgraph=True)`, built here from our config's shape
with random weights and timed on the workload's prompts. docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import importlib
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

from infer_bench.engine_runner import default_dtype, free_memory, primary_rate, request_metrics
from infer_bench.peers import TimedRequest
from infer_bench.workloads import Workload, build_requests
from infer.engine.loading import resolve_device
from infer.models.config import ModelConfig
from infer.models.loading.loader import load_model
from infer.timing import synchronize

REQUIRED_FILES = ("model.py", "generate.py")


def missing_files(checkout: Path) -> list[str]:
    """The files a gpt-fast checkout must hold that `checkout` lacks."""
    return [f for f in REQUIRED_FILES if not (checkout / f).is_file()]


def _import_gpt_fast(checkout: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """(its model module, its generate module), imported from `checkout`."""
    if missing := missing_files(checkout):
        raise FileNotFoundError(f"{checkout} is not a gpt-fast checkout: it lacks {', '.join(missing)}")
    path = str(checkout.resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        importlib.import_module("tokenizer")
    except ImportError:  # sentencepiece / tiktoken absent: never used here
        stand_in = types.ModuleType("tokenizer")
        stand_in.get_tokenizer = None  # type: ignore[attr-defined]
        sys.modules["tokenizer"] = stand_in
    return importlib.import_module("model"), importlib.import_module("generate")


def model_args(module: types.ModuleType, config: ModelConfig, block_size: int) -> Any:
    """gpt-fast's ModelArgs for our config's shape."""
    scaling = config.rope_scaling
    return module.ModelArgs(
        block_size=block_size, vocab_size=config.vocab_size, n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads, n_local_heads=config.num_key_value_heads, dim=config.hidden_size,
        intermediate_size=config.intermediate_size, rope_base=config.rope_theta, norm_eps=config.rms_norm_eps,
        rope_scaling=None if scaling is None else dict(
            factor=scaling.factor, low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings))


def run_gpt_fast(checkout: Path, model: str, workload: Workload, *, device: str = "auto"
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time gpt-fast's compiled greedy decode on every request of `workload`; (params, metrics)."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise RuntimeError("the gpt-fast peer times CUDA graphs: it needs --device cuda")
    dtype = getattr(torch, default_dtype(dev))
    gf_model, gf_generate = _import_gpt_fast(checkout)
    meta, config = load_model(model, dtype=dtype, device="meta", load_format="dummy")
    del meta
    prompts = build_requests(workload, config.vocab_size, None)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in prompts.requests)
    with torch.device(dev):
        net = gf_model.Transformer(model_args(gf_model, config, longest + 8))
    net = net.to(dtype=dtype).eval().requires_grad_(False)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    with torch.device(dev):
        net.setup_caches(max_batch_size=1, max_seq_length=longest + 8)
    step = torch.compile(gf_generate.decode_one_token, mode="reduce-overhead", fullgraph=True)
    try:
        start = time.perf_counter()
        _decode(net, gf_generate, step, prompts.requests[0].prompt_ids, prompts.requests[0].max_tokens, dev)
        compile_s = time.perf_counter() - start  # the first request compiles and captures
        timed: list[TimedRequest] = []
        synchronize(dev)
        start = time.perf_counter()
        for spec in prompts.requests:
            timed.append(_decode(net, gf_generate, step, spec.prompt_ids, spec.max_tokens, dev))
        wall = time.perf_counter() - start
        metrics = request_metrics(timed, wall)
        metrics.update(expected_output_tokens=prompts.expected_output_tokens, compile_s=compile_s)
        metrics["primary_rate"] = primary_rate(metrics, workload.num_requests)
        params = {"workload": workload.to_dict(), "prompt_source": prompts.source, "peer": "gpt-fast",
                  "checkout": str(checkout), "model": model, "dtype": str(dtype),
                  "compile": "decode_one_token: torch.compile(mode='reduce-overhead', fullgraph=True)"}
        return params, metrics
    finally:
        del net, step
        free_memory()


@torch.inference_mode()
def _decode(net: torch.nn.Module, gf_generate: types.ModuleType, step: Any, prompt: list[int], max_new: int,
            dev: torch.device) -> TimedRequest:
    """Prefill `prompt` eagerly (as gpt-fast does by default), then `max_new` - 1 compiled
    greedy steps; the arrival time of the first and of the last token."""
    arrival = time.perf_counter()
    ids = torch.tensor([prompt], device=dev)
    positions = torch.arange(len(prompt), device=dev)
    token = gf_generate.prefill(net, ids, positions, temperature=0.0).view(1, 1)
    synchronize(dev)
    first = time.perf_counter()
    out = [token]
    position = torch.tensor([len(prompt)], device=dev)
    for _ in range(max_new - 1):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # as gpt-fast's decode loop
            token, _ = step(net, token, position, temperature=0.0)
        position += 1
        token = token.clone()
        out.append(token)
    synchronize(dev)
    return TimedRequest([int(t) for t in torch.cat(out).view(-1).tolist()], arrival, first, time.perf_counter())
