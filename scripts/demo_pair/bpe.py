"""Byte-level BPE tokenizer of the demo models, trained with the `tokenizers` library.

Pre-tokenization is Llama 3's: a regex split (letters with one leading non-letter, numbers
of at most three digits, punctuation runs, newline runs, whitespace runs) followed by the
GPT-2 byte-to-unicode mapping, so every byte string is encodable and decoding is exact.
Special tokens come first: `<|bos|>` = 0, `<|eos|>` = 1, `<|pad|>` = 2. A template
post-processor puts BOS in front of every encoded text (as Llama 3's tokenizer.json does);
`tokenizer_config.json` says the same with `add_bos_token: true`.

`save_tokenizer_files` writes the standard Hugging Face files (tokenizer.json,
tokenizer_config.json with a small chat template, special_tokens_map.json), which load in
`infer.tokenization.Tokenizer` and in transformers' `AutoTokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 8192
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Messages as Python comment blocks: the demo models are code models, not chat models,
# so the template only has to give `chat` something well formed to continue.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' }}"
    "{% for line in message['content'].split('\\n') %}{{ '# ' + line + '\\n' }}{% endfor %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE with the Llama 3 split and a BOS post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` entries (special tokens and 256 bytes included)."""
    floor = len(SPECIAL_TOKENS) + 256
    if vocab_size <= floor:
        raise ValueError(f"vocab_size must exceed {floor} (specials + 256 byte tokens), got {vocab_size}")
    if not texts:
        raise ValueError("train_tokenizer needs at least one text")
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for token, expected in zip(SPECIAL_TOKENS, (BOS_ID, EOS_ID, PAD_ID), strict=True):
        if tok.token_to_id(token) != expected:
            raise RuntimeError(f"special token {token} got id {tok.token_to_id(token)}, expected {expected}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, BOS_ID)])
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json contents."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer_files(tok: Tokenizer, directory: str | Path, model_max_length: int) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(directory / "special_tokens_map.json",
                {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    return directory


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {str(directory)!r}: train one with "
                                "python -m demo_pair.train or pass a model directory")
    return Tokenizer.from_file(str(path))


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One stream of token ids [N]: BOS + text + EOS for each text, concatenated."""
    encodings = tok.encode_batch(list(texts), add_special_tokens=False)
    pieces = []
    for enc in encodings:
        pieces.append(torch.tensor([BOS_ID, *enc.ids, EOS_ID], dtype=torch.long))
    if not pieces:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(pieces)  # [N]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
