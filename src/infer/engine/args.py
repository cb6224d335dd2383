"""Command-line flags for EngineConfig, shared by `infer generate | serve | bench` and
`python -m infer.server`: one flag per field (`--max-batch-size`; `--speculative-decoding` for
`use_speculative_decoding`). A speculation flag typed turns speculation on; `--enforce-eager` is
`--no-use-cuda-graphs`. `engine_config_from_args` checks the flags before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from infer.engine.config import SPECULATION_FIELDS, EngineConfig
from infer.engine.parts import CHOICES

_ALIASES = {"use_speculative_decoding": ["--speculative-decoding"]}
_HELP = {
    "max_seq_len": "tokens a sequence holds, prompt and output; default: the model's own context, capped by "
                   "what the KV memory holds (1 GiB of KV on a CPU)",
    "speculative_method": "where drafts come from (turns --speculative-decoding on)",
    "model": "local model directory (Hugging Face layout), hub id or llama.cpp .gguf file; default: the "
             "bundled demo target",
    "draft_model": "draft model for speculative decoding (directory, hub id or .gguf file; turns "
                   "--speculative-decoding on); default with the demo target: the demo draft (with "
                   "--speculative-method eagle3: its EAGLE-3 head)",
    "spec_length": "K, tokens drafted per speculation round (the maximum with --spec-policy adaptive); "
                   "default: 5, or the depth of --spec-tree",
    "spec_draft_vocab": "a reduced draft vocabulary: a table `infer draft-vocab` wrote, or a shipped one "
                        "(llama3-32k: the Llama 3 tokenizer's 32,768 ids; demo-6k: the demo's 6,144)",
    "spec_tree": "tree speculation: children per node at each depth, e.g. 3,2,1,1 (its depth is K; fixed "
                 "policy only); dynamic:N[:B] for a draft model's or suffix decoding's trees of N nodes",
    "spec_suffix_max_depth": "--speculative-method suffix: substrings of up to this many tokens are counted (a match "
                             "of m tokens leaves this - m to draft; more than --spec-length)",
    "spec_suffix_cache_tokens": "--speculative-method suffix: tokens of finished requests' outputs every request "
                                "drafts from, the oldest evicted (0: each request drafts from its own tokens alone)",
    "spec_suffix_min_prob": "--speculative-method suffix: the least estimated probability of a draft node",
    "device": "auto | cpu | cuda[:N]",
    "max_batch_size": "requests decoded together; default: sized from the GPU's memory (KV of --max-seq-len "
                      "tokens each beside the weights, at most 256), 8 on a CPU",
    "seed": "sampling seed of requests that set none (the same command gives the same text)",
    "threads": "CPU threads for torch; default: one per 250M parameters, at most half the cores (small models "
               "decode fastest on one thread)",
    "load_format": "auto | safetensors | dummy (random weights; 'dummy:llama-3.2-3b' style model names)",
    "cuda_graph_sampling_batch_max": "largest batch whose EAGLE head rounds run as one CUDA graph each (less: "
                                     "less GPU memory with a large vocabulary; 0: none)",
    "tensor_parallel_size": "GPUs (ranks) the model is split over; the engine starts N-1 worker processes, or "
                            "joins the ranks torchrun started",
    "tensor_parallel_embedding": "replicated | vocab_parallel: each rank holds the whole embedding, or V/N rows "
                                 "(plus one all-reduce a step)",
    "tensor_parallel_lm_head": "vocab_parallel | replicated: each rank computes V/N logits (all-gathered), or all",
    "tensor_parallel_draft": "driver | sharded: the draft model whole on rank 0, or split over the ranks",
    "tensor_parallel_all_reduce": "nccl | one-shot: small all-reduces (decode steps) by one kernel over NVLink "
                                  "peer memory, NCCL for the rest",
    "mixed_batches": "run prefill chunks and plain decode rows of a step in one packed forward "
                     "(default: on; --no-mixed-batches: a forward each)",
}


_OPTIONAL_BOOL_HELP = {
    "use_speculative_decoding": "speculative decoding: a draft proposes K tokens, the model verifies them in one "
                                "forward (lossless); the draft is --speculative-method's (default: on when a "
                                "speculation flag such as --spec-length or --draft-model is given)",
    "use_cuda_graphs": "capture decode and speculation steps as CUDA graphs, less CPU launch overhead (default: on "
                       "for CUDA devices, with the fused kernels; --enforce-eager turns both off)",
    "enable_prefix_caching": "default: on for the paged backend",
    "compile_kernels": "fused kernels: torch.compile'd elementwise ops and rotary, Triton FP8 matmuls "
                       "(default: on with CUDA graphs)",
    "async_scheduling": "overlap the host's work with the GPU's: prepare step n+1 while step n runs "
                        "(default: on for CUDA devices)",
    "spec_batch_gate": "time speculation rounds against plain steps per batch size and step plainly where rounds "
                       "give fewer tokens a second, probing again now and then (default: on for CUDA devices; "
                       "off, every step drafts and nothing depends on timing)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        names = [flag, *_ALIASES.get(field.name, [])]
        hint = hints[field.name]
        help_text = _HELP.get(field.name, "")
        if hint is bool:  # on by default: --no-<flag> turns it off
            action = argparse.BooleanOptionalAction if field.default else "store_true"
            group.add_argument(*names, dest=field.name, action=action, default=field.default, help=help_text)
        elif hint == bool | None:  # on, off, or the engine's default
            group.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=_OPTIONAL_BOOL_HELP[field.name])
        else:
            base = _base_type(hint)
            shown = "" if field.default is None and "default:" in help_text else f" (default: {field.default})"
            action = _Given if field.name in SPECULATION_FIELDS else "store"
            group.add_argument(*names, dest=field.name, type=base, default=field.default, action=action,
                               choices=CHOICES.get(field.name), help=f"{help_text}{shown}".strip())
    group.add_argument("--enforce-eager", action="store_true",
                       help="vLLM's name for --no-use-cuda-graphs: every step eager, without CUDA graphs (and "
                            "without the fused kernels unless --compile-kernels)")


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


class _Given(argparse.Action):
    """Stores the value and notes that the flag was typed (`given_<dest>`), whatever its value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"given_{self.dest}", True)


def dash_flags(argv: list[str]) -> list[str]:
    """Flags in their underscore spelling (`--max_tokens 8`) as dashed flags (`--max-tokens 8`);
    values (`--stop=a_b`) and everything after `--` unchanged."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        out.append(name.replace("_", "-") + eq + value if arg.startswith("--") else arg)
    return out


def flag(field: str) -> str:
    """The command-line flag of an EngineConfig field."""
    return _ALIASES.get(field, ["--" + field.replace("_", "-")])[0]


def flag_text(message: str) -> str:
    """An EngineConfig error rewritten with flags for fields: "set use_speculative_decoding=True"
    -> "set --speculative-decoding", "spec_policy='fixed'" -> "--spec-policy fixed"."""
    names = sorted((f.name for f in dataclasses.fields(EngineConfig)), key=len, reverse=True)
    pattern = re.compile(rf"(?<![-\w'])({'|'.join(names)})\b(=True\b|=False\b|='[^']*'|=[^\s,;:)]+)?")

    def replace(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if value is None and "_" not in name and match.start() > 0:
            return match.group(0)  # one-word names ("model", "device") are also plain words
        option = flag(name)
        if value in (None, "=True"):
            return option
        if value == "=False":
            return f"no {option}"
        return f"{option} {value[1:].strip(chr(39))}"

    return pattern.sub(replace, message)


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags give: a speculation flag typed turns speculation on,
    --enforce-eager CUDA graphs off (ValueError when contradicted by another flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    given = [flag(name) for name in SPECULATION_FIELDS if getattr(args, f"given_{name}", False)]
    if given and values["use_speculative_decoding"] is False:
        raise ValueError(f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} speculative decoding, "
                         "which --no-speculative-decoding turns off: drop one or the other")
    if given:
        values["use_speculative_decoding"] = True
    if getattr(args, "enforce_eager", False):
        if values["use_cuda_graphs"]:
            raise ValueError("--enforce-eager and --use-cuda-graphs contradict each other: drop one")
        values["use_cuda_graphs"] = False
    return values


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags; ValueError (naming flags) or FileNotFoundError before
    any weight loads."""
    from infer.engine.defaults import check_device_options
    from infer.engine.loading import resolve_device

    values = engine_values(args)
    try:
        config = EngineConfig(**values)
        check_device_options(config, resolve_device(config.device))  # (its warnings: when the engine starts)
    except ValueError as exc:
        raise ValueError(flag_text(str(exc))) from None
    check_model_paths(config)
    return config


def check_model_paths(config: EngineConfig) -> None:
    """FileNotFoundError (naming the flag) for a --model or --draft-model that is no local
    directory, GGUF file or hub id."""
    from infer.engine.loading import model_sources
    from infer.models.loading.readers import resolve_model_path

    if config.load_format == "dummy":
        return
    target, draft, _, _ = model_sources(config)
    for name, path in (("model", target), ("draft_model", draft)):
        if path is None or path.startswith("dummy:") or Path(path).expanduser().is_file():
            continue
        try:
            resolve_model_path(path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{flag(name)}: {exc}") from None
