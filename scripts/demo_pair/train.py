"""Train the demo target and draft: `python -m demo_pair.train --out DIR`.

Pipeline: the stdlib corpus (`infer.corpus`) -> byte-level BPE on the training split
(`demo_pair.bpe`) -> the target, next-token loss -> the draft, distilled from the target
as saved (bf16 weights reloaded through infer's loader, so the draft learns the model that
ships). Writes DIR/target and DIR/draft in Hugging Face layout (sharded bf16 safetensors +
index, config.json, generation_config.json, tokenizer files, training_summary.json) and
the loss history to LOG_DIR/train_log.json.

    PYTHONPATH=src:scripts python -m demo_pair.train --out /tmp/demo --preset tiny   # CPU smoke
    PYTHONPATH=src:scripts python -m demo_pair.train --out src/infer/demo_models      # GPU, full
    PYTHONPATH=src:scripts python -m demo_pair.train --out DIR --models draft         # draft only

Seeded: same seed, corpus and device give the same batches and initial weights (bitwise
identical results on CPU; on CUDA up to non-deterministic reduction order in kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from demo_pair import ROLES
from demo_pair.bpe import (
    encode_documents,
    load_tokenizer,
    save_tokenizer_files,
    train_tokenizer,
)
from demo_pair.data import read_texts, validation_chunks
from demo_pair.presets import (
    PRESETS,
    Preset,
    TrainSettings,
    config_with,
    get_preset,
    settings_with,
    with_seq_len,
)
from demo_pair.saving import save_model, training_environment
from demo_pair.trainer import init_weights, train_model
from infer.corpus import split_corpus, stdlib_root
from infer.engine.loading import resolve_device
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.loader import load_model


@dataclass
class Corpus:
    """Encoded streams plus what the model cards report about them."""

    train: torch.Tensor  # [N_train]
    valid: torch.Tensor  # [N_valid]
    stats: dict[str, Any]


def prepare_corpus(preset: Preset, tok: Tokenizer | None, vocab_size: int) -> tuple[Tokenizer, Corpus]:
    """Split and read the stdlib, train the tokenizer if none is given, encode both splits."""
    split = split_corpus()
    train_files, valid_files = split.train, split.valid
    if preset.max_files is not None:
        train_files = train_files[:preset.max_files]
        valid_files = valid_files[:max(2, preset.max_files // 10)]
    train_texts, valid_texts = read_texts(train_files), read_texts(valid_files)
    if tok is None:
        tok = train_tokenizer(train_texts, vocab_size)
    train, valid = encode_documents(tok, train_texts), encode_documents(tok, valid_texts)
    stats = {
        "python_version": split.python_version,
        "python_build": sys.version,
        "stdlib_root": str(stdlib_root()),
        "train_files": len(train_files), "valid_files": len(valid_files),
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "valid_bytes": sum(len(t.encode("utf-8")) for t in valid_texts),
        "train_tokens": int(train.numel()), "valid_tokens": int(valid.numel()),
        "subset_of_files": preset.max_files,
    }
    return tok, Corpus(train, valid, stats)


def train_role(role: str, preset: Preset, corpus: Corpus, tok: Tokenizer, out: Path,
               device: torch.device, seed: int, teacher: LlamaForCausalLM | None) -> dict[str, Any]:
    """Build, train and save one model; returns its training summary."""
    config = preset.target if role == "target" else preset.draft
    settings = preset.target_train if role == "target" else preset.draft_train
    model = LlamaForCausalLM(config)
    init_weights(model, seed=seed + (0 if role == "target" else 1000))
    model.to(device)
    chunks = validation_chunks(corpus.valid, preset.seq_len)
    log = train_model(model, corpus.train, chunks, settings, device=device,
                      seed=seed + (0 if role == "target" else 1000), role=role, teacher=teacher)
    summary = {
        "role": role, "seed": seed, "num_parameters": config.num_parameters(),
        "seq_len": preset.seq_len, "corpus": corpus.stats, "environment": training_environment(device),
        "distilled_from": "target" if teacher is not None and settings.distill_weight > 0 else None,
        "log": log.to_dict(),
    }
    save_model(model, out / role, tok, summary)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = _preset_from_args(args)
    out = Path(args.out)
    device = resolve_device(args.device)
    roles = [r.strip() for r in args.models.split(",") if r.strip()]
    if not roles or any(r not in ROLES for r in roles):
        raise ValueError(f"--models must list some of {ROLES}, got {args.models!r}")
    tok = None if "target" in roles else load_tokenizer(out / "target")
    tok, corpus = prepare_corpus(preset, tok, preset.vocab_size)
    if tok.get_vocab_size() != preset.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but the preset expects "
                         f"{preset.vocab_size}: pass the matching --vocab-size")
    print(f"corpus: {json.dumps(corpus.stats)}", flush=True)
    summaries: dict[str, Any] = {}
    if "target" in roles:
        save_tokenizer_files(tok, out / "target", preset.seq_len)
        summaries["target"] = train_role("target", preset, corpus, tok, out, device, args.seed, None)
    if "draft" in roles:
        teacher, _ = load_model(str(out / "target"), dtype=torch.float32, device=device)
        summaries["draft"] = train_role("draft", preset, corpus, tok, out, device, args.seed, teacher)
    log_path = Path(args.log_dir or out) / "train_log.json"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(log_path.read_text(encoding="utf-8")) if log_path.is_file() else {}
    log_path.write_text(json.dumps({**earlier, **summaries}, indent=2) + "\n", encoding="utf-8")
    return summaries


def _preset_from_args(args: argparse.Namespace) -> Preset:
    preset = get_preset(args.preset)
    if args.seq_len is not None:
        preset = with_seq_len(preset, args.seq_len)
    if args.vocab_size is not None:
        preset = replace(preset, vocab_size=args.vocab_size,
                         target=replace(preset.target, vocab_size=args.vocab_size),
                         draft=replace(preset.draft, vocab_size=args.vocab_size))
    preset = replace(preset, target=config_with(preset.target, args.target_shape or []),
                     draft=config_with(preset.draft, args.draft_shape or []))
    return replace(
        preset,
        target_train=_override(preset.target_train, args.target_epochs, args.max_steps, args.target_set),
        draft_train=_override(preset.draft_train, args.draft_epochs, args.max_steps, args.draft_set))


def _override(s: TrainSettings, epochs: float | None, max_steps: int | None,
              overrides: list[str] | None) -> TrainSettings:
    s = replace(s, epochs=epochs if epochs is not None else s.epochs,
                max_steps=max_steps if max_steps is not None else s.max_steps)
    return settings_with(s, overrides or [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo_pair.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="writes OUT/target and OUT/draft")
    p.add_argument("--log-dir", help="where train_log.json goes (default: --out)")
    p.add_argument("--preset", choices=PRESETS, default="full", help="'tiny' for a CPU smoke run")
    p.add_argument("--models", default="target,draft",
                   help="which to train; 'draft' alone distils from OUT/target")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, help="training sequence = context length (preset: 1024)")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary (preset: 8192)")
    p.add_argument("--target-epochs", type=float)
    p.add_argument("--draft-epochs", type=float)
    p.add_argument("--max-steps", type=int, help="cap on steps per model (smoke runs)")
    p.add_argument("--target-set", action="append", metavar="NAME=VALUE",
                   help="override a training setting of the target, e.g. dropout=0.3 (repeatable)")
    p.add_argument("--draft-set", action="append", metavar="NAME=VALUE",
                   help="override a training setting of the draft, e.g. lr=0.002 (repeatable)")
    p.add_argument("--target-shape", action="append", metavar="NAME=VALUE",
                   help="override a shape field of the target, e.g. hidden_size=448 (repeatable)")
    p.add_argument("--draft-shape", action="append", metavar="NAME=VALUE",
                   help="override a shape field of the draft, e.g. intermediate_size=384 (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(f"python {platform.python_version()}, torch {torch.__version__}", flush=True)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
