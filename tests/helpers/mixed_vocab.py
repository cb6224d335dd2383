"""A tiny model whose byte-level BPE vocabulary makes every pre-tokenizer show.

The vocabulary is trained on `CORPUS` (code, digits, Latin, Cyrillic, Greek, CJK, Hangul,
Arabic, emoji, whitespace runs, contractions, camelCase) with no pre-tokenizer at all, so
its merges run across letters, digits, spaces and punctuation alike: any two ways of cutting
text into pieces give different ids. `make_mixed_checkpoint(dir)` writes a complete tiny
model directory (helpers.checkpoints) with that tokenizer.json in place of the usual one.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from helpers.checkpoints import make_checkpoint

SPECIALS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..3; <s> is BOS, </s> EOS
CORPUS = """\
def parse(x: int) -> list[int]:\n    return [x ** 2 for x in range(10)]  # squares\n
if (a+=12345) { printf("%d\\n", 3.14159); } else return -42;\t\t// done
The year 2024-01-01 had 365 days, 8760 hours and 525600 minutes; call 555-1234.
Привет, мир! Как дела? Ελληνικά γράμματα. Ωmega and µ-law.
日本語のテキストと中文字符，还有한국어 문장입니다。
مرحبا بالعالم 🦙🚀👍🏽 emoji 😀😀 spam!!! ... --- ???
don't I'LL we've they'd SHE'S it's helloWorld XMLHttpRequest getHTTPResponse
   leading spaces    and    runs\n\n\n   of\twhitespace \r\n windows line \u00a0nbsp
<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>
"""
VOCAB_SIZE = 1200


@functools.lru_cache(maxsize=1)
def mixed_tokenizer_json() -> str:
    """The trained tokenizer.json text (no pre-tokenizer, byte-level alphabet, no BOS template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 3, trainer=trainer)
    return tok.to_str()


def make_mixed_checkpoint(directory: str | Path, variant: str = "b", seed: int = 0) -> Path:
    """A tiny model directory (random weights) whose tokenizer is the mixed vocabulary."""
    text = mixed_tokenizer_json()
    size = len(json.loads(text)["model"]["vocab"])
    directory = make_checkpoint(directory, variant=variant, seed=seed, vocab_size=size)
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    return directory
