"""`infer draft-vocab`: build a reduced draft vocabulary's table (speculative/draft_vocab.py).

Counts the target tokenizer's tokens over `--files`, the demo corpus's train split (`--demo-corpus`) or the target's
greedy outputs on `--prompts-file` (one prompt a line), keeps the `--size` most frequent (end-of-sequence ids always
among them) and writes the table to `--out` with its coverage (the share of counted tokens inside the table).
An engine reads it with `--spec-draft-vocab PATH` (EngineConfig.spec_draft_vocab)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from infer.engine.loading import DEMO_TARGET, load_tokenizer
from infer.models.loading.loader import read_model_config
from infer.speculative.draft_vocab import DraftVocab, build_table, count_tokens
from infer.tokenization import Tokenizer


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the target model whose tokenizer counts the corpus (directory, "
                                                  "hub id or .gguf); default: the bundled demo target")
    p.add_argument("--size", type=int, required=True, help="N, tokens the table keeps (e.g. 32768)")
    p.add_argument("--out", required=True, help="the table's file (JSON) to write")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--files", nargs="+", metavar="PATH", help="text files to count")
    source.add_argument("--demo-corpus", action="store_true",
                        help="the demo pair's training corpus (the stdlib's .py files, train split)")
    source.add_argument("--prompts-file", metavar="PATH",
                        help="count the target's greedy outputs on these prompts (one a line)")
    p.add_argument("--max-tokens", type=int, default=128, help="--prompts-file: tokens generated per prompt "
                                                               "(default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.size < 1:
        raise ValueError(f"--size must be >= 1, got {args.size}")
    model = args.model if args.model is not None else str(DEMO_TARGET)
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model!r} has no tokenizer to count a corpus with")
    vocab_size = read_model_config(model).vocab_size
    if args.prompts_file is not None:
        counts, corpus = greedy_counts(model, Path(args.prompts_file), args.max_tokens), \
            f"the target's greedy outputs on {args.prompts_file}"
    else:
        paths = demo_corpus() if args.demo_corpus else [Path(f) for f in args.files]
        counts = text_counts(tokenizer, paths)
        corpus = "the demo corpus (stdlib .py, train split)" if args.demo_corpus else \
            f"{len(paths)} file{'' if len(paths) == 1 else 's'} ({', '.join(map(str, paths[:3]))}" + \
            (", ...)" if len(paths) > 3 else ")")
    table = build_table(counts, min(args.size, vocab_size), vocab_size, corpus, tokenizer.eos_token_ids)
    table.save(args.out)
    print(report(table, args.out))
    return 0


def report(table: DraftVocab, path: str) -> str:
    return f"wrote {path}: {table.describe()}"


def text_counts(tokenizer: Tokenizer, paths: list[Path]) -> Counter[int]:
    """Token counts of the files' text (no special tokens added)."""
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no file {str(missing[0])!r} to count")
    return count_tokens(tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
                        for p in paths)


def demo_corpus() -> list[Path]:
    from infer.corpus import split_corpus

    return split_corpus().train


def greedy_counts(model: str, prompts_file: Path, max_tokens: int) -> Counter[int]:
    """Token counts of the target's greedy continuations of each prompt (the outputs alone)."""
    from infer import LLM, SamplingParams

    if not prompts_file.is_file():
        raise ValueError(f"no prompts file {str(prompts_file)!r}")
    prompts = [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{prompts_file} holds no prompt")
    with LLM(model=model) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return count_tokens(o.outputs[0].token_ids for o in outputs)
