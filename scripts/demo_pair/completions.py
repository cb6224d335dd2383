"""Greedy completions of code prompts for the demo model cards, and which ones to show.

Each prompt is a definition header (often with its docstring) that ends where the training
text would naturally continue: after a newline, so the tokenizer's merged ":\\n" token is
complete (a prompt ending in "):" alone, or in trailing spaces, splits tokens in a way the
model never saw). The model continues greedily; the shown text stops where the prompt's
top-level block ends (the first later line that starts in column 0), as an editor's
completion would, and the raw continuation is kept next to it. Small greedy models tend to
loop, so every prompt gets a repetition score (the share of repeated word 3-grams); the cards
show first the longest of those that repeat little (`pick_examples`), then the rest, and
the results JSON keeps every completion, raw and cut.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer

from demo_pair.bpe import EOS_ID
from demo_pair.trainer import autocast, forward_logits
from infer.models.llama import LlamaForCausalLM

PROMPTS = (
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'class Stack:\n    """A last-in, first-out stack of items."""\n\n    def __init__(self):\n',
    ("import os\n\n\ndef list_python_files(directory):\n"
     '    """Return the paths of the .py files in directory."""\n'),
    "def read_lines(path, encoding='utf-8'):\n",
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
     "    def __repr__(self):\n"),
    "def _check_positive(value, name):\n    if value <= 0:\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(\n",
    'def _quote(s):\n    """Return s in single quotes, escaping backslashes and quotes."""\n',
    "try:\n    import _locale\nexcept ImportError:\n",
    'def copy(self):\n    """Return a shallow copy of the mapping."""\n',
    "def _get_default_timeout(timeout):\n    if timeout is None:\n",
)
NGRAM = 3
MAX_REPETITION = 0.2  # share of repeated word 3-grams that still reads as fluent


@torch.no_grad()
def greedy_complete(model: LlamaForCausalLM, tok: Tokenizer, prompt: str, max_new_tokens: int,
                    device: torch.device) -> str:
    """Greedy continuation of `prompt` (BOS added), recomputing the whole prefix each step."""
    ids = tok.encode(prompt).ids
    limit = model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        if len(ids) >= limit:
            break
        x = torch.tensor([ids], device=device)  # [1, T]
        with autocast(device):
            nxt = int(forward_logits(model, x)[0, -1].argmax())
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    text = tok.decode(ids, skip_special_tokens=True)
    return text.removeprefix(prompt)


def end_of_block(prompt: str, completion: str) -> str:
    """`completion` cut before its first line that starts in column 0 (a new top-level
    statement: the prompt's definition has ended), trailing blank lines dropped. Module-level
    lines of the prompt itself (an `import` before the `def`) do not count: only the
    completion is searched."""
    lines = completion.split("\n")
    start = 0 if prompt.endswith("\n") else 1  # a first partial line continues the prompt's
    for i in range(start, len(lines)):
        if lines[i] and not lines[i][0].isspace() and not lines[i].startswith((")", "]", "}")):
            lines = lines[:i]
            break
    return "\n".join(lines).rstrip() + "\n"


def repetition(text: str, n: int = NGRAM) -> float:
    """Share of the word n-grams of `text` that repeat an earlier one (0: none repeats);
    0 for texts shorter than n words."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def complete_all(model: LlamaForCausalLM, tok: Tokenizer, prompts: tuple[str, ...],
                 max_new_tokens: int, device: torch.device) -> list[dict[str, Any]]:
    """For each prompt: the raw greedy continuation, the shown part and its repetition."""
    rows = []
    for prompt in prompts:
        raw = greedy_complete(model, tok, prompt, max_new_tokens, device)
        shown = end_of_block(prompt, raw)
        rows.append({"prompt": prompt, "completion": raw, "shown": shown,
                     "repetition": repetition(shown)})
    return rows


def pick_examples(rows: list[dict[str, Any]], count: int,
                  max_repetition: float = MAX_REPETITION) -> list[int]:
    """Indices of `count` rows to show: first those whose shown text repeats little
    (repetition <= max_repetition), longest first; then the least repetitive others. Rows
    whose shown text is empty never come. Prompt order breaks ties."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")

    def key(i: int) -> tuple[bool, float, int]:
        r = rows[i]
        fluent = r["repetition"] <= max_repetition
        lines = sum(1 for line in r["shown"].split("\n") if line.strip())
        return (not fluent, -lines if fluent else r["repetition"], i)

    usable = [i for i, r in enumerate(rows) if r["shown"].strip()]
    return sorted(usable, key=key)[:count]
