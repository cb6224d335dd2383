"""Command-line flags for EngineConfig, shared by `infer generate`, `infer serve`, `infer bench`
and `python -m infer.server`. One flag per field (`--max-batch-size`), plus the
specification's short names `--speculative-decoding`, `--draft-model`, `--spec-length`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from infer.engine.config import EngineConfig

_ALIASES = {"use_speculative_decoding": ["--speculative-decoding"]}
_HELP = {
    "model": "local model directory (Hugging Face layout), hub id or llama.cpp .gguf file; default: the "
             "bundled demo target",
    "draft_model": "draft model for speculative decoding (directory, hub id or .gguf file); default with the "
                   "demo target: the demo draft",
    "spec_length": "K, tokens drafted per speculation round (the maximum with --spec-policy adaptive); "
                   "default: 5, or the depth of --spec-tree",
    "spec_tree": "tree speculation: children per node at each depth, e.g. 3,2,1,1 (its depth is K; fixed "
                 "policy only)",
    "device": "auto | cpu | cuda[:N]",
    "seed": "sampling seed of requests that set none (the same command gives the same text)",
    "threads": "CPU threads for torch; default: one per 250M parameters, at most half the cores (small models "
               "decode fastest on one thread)",
    "load_format": "auto | safetensors | dummy (random weights; 'dummy:llama-3.2-3b' style model names)",
    "cuda_graph_sampling_batch_max": "largest batch whose steps also get sampling, acceptance and draft-round "
                                     "graphs (less: less GPU memory with a large vocabulary; 0: none)",
    "tensor_parallel_size": "GPUs (ranks) the model is split over; the engine starts N-1 worker processes, or "
                            "joins the ranks torchrun started",
    "tensor_parallel_embedding": "replicated | vocab_parallel: each rank holds the whole embedding, or V/N rows "
                                 "(plus one all-reduce a step)",
    "tensor_parallel_lm_head": "vocab_parallel | replicated: each rank computes V/N logits (all-gathered), or all",
    "tensor_parallel_draft": "driver | sharded: the draft model whole on rank 0, or split over the ranks",
}


_OPTIONAL_BOOL_HELP = {
    "enable_prefix_caching": "default: on for the paged backend",
    "compile_kernels": "fused kernels: torch.compile'd elementwise ops and rotary, Triton FP8 matmuls "
                       "(default: on with CUDA graphs)",
    "async_scheduling": "overlap the host's work with the GPU's: prepare step n+1 while step n runs "
                        "(default: on for CUDA devices)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        names = [flag, *_ALIASES.get(field.name, [])]
        hint = hints[field.name]
        help_text = _HELP.get(field.name, "")
        if hint is bool:
            group.add_argument(*names, dest=field.name, action="store_true", default=field.default, help=help_text)
        elif hint == bool | None:  # on, off, or the engine's default
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=_OPTIONAL_BOOL_HELP[field.name])
        else:
            base = _base_type(hint)
            shown = "" if field.default is None and "default:" in help_text else f" (default: {field.default})"
            group.add_argument(*names, dest=field.name, type=base, default=field.default,
                               help=f"{help_text}{shown}".strip())


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**values)
