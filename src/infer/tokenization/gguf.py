"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library.

A GGUF file has no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`),
token types, BPE merges or SentencePiece scores, special ids and the chat template as
metadata. Two vocabulary kinds (`tokenizer.ggml.model`) are supported, as llama.cpp runs
them:

- "gpt2": byte-level BPE. The text is split by the regex the file names in
  `tokenizer.ggml.pre` ("llama-bpe" = Llama 3's, "gpt-2"); Llama 3's whole-word lookup
  (`ignore_merges`) is kept. A pre-tokenizer without an equivalent here is an error, not
  an approximation.
- "llama": SentencePiece BPE (Llama 2 style): pieces with "▁" for spaces, merged in the
  order of their scores, byte fallback to the <0xXX> pieces, a "▁" prefix before each run
  of text (at the start and after each special token, as llama.cpp and SentencePiece
  do) unless `tokenizer.ggml.add_space_prefix` is false.

Control (and unknown) tokens become special added tokens, user-defined ones plain added
tokens, so their strings in a prompt map to their ids. A file without a chat template whose
vocabulary has Llama 3's header tokens gets the built-in Llama 3 template, as a directory
does.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from infer.models.gguf.config import stop_token_ids
from infer.models.gguf.reader import GGUFFile
from infer.tokenization.backends import LLAMA3_PATTERN, HFTokenizersBackend
from infer.tokenization.chat import LLAMA3_CHAT_TEMPLATE
from infer.tokenization.tokenizer import LLAMA3_HEADER_TOKENS, Tokenizer

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp runs a named byte-level pre-tokenizer (`tokenizer.ggml.pre`)."""

    pattern: str  # the regex text is split by before BPE
    ignore_merges: bool  # a piece found whole in the vocabulary is one token, unmerged
    add_bos: bool  # BOS is added when the file does not say (tokenizer.ggml.add_bos_token)


LLAMA3 = PreTokenizer(LLAMA3_PATTERN, ignore_merges=True, add_bos=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "llama-bpe": LLAMA3, "llama3": LLAMA3, "llama-v3": LLAMA3, "smaug-bpe": LLAMA3,
    "gpt-2": PreTokenizer(GPT2_PATTERN, ignore_merges=False, add_bos=False),
}
SPACE = "▁"  # SentencePiece's visible space
SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The `Tokenizer` of a GGUF file: vocabulary, special ids, stop ids, chat template."""
    gguf = GGUFFile.open(path)
    tokens: list[str] = gguf.value("tokenizer.ggml.tokens")
    types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    kind = gguf.value("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = gguf.get("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF file {str(gguf.path)!r} names the pre-tokenizer {pre!r}, which infer does not "
                f"implement (supported: {', '.join(PRE_TOKENIZERS)}); a file without one was made by "
                "an old llama.cpp: re-convert it")
        tok = byte_level_bpe(tokens, types, gguf.value("tokenizer.ggml.merges"), pre)
        add_bos_default = PRE_TOKENIZERS[pre].add_bos
    elif kind == "llama":
        tok = sentencepiece_bpe(tokens, types, gguf.value("tokenizer.ggml.scores"),
                                gguf.get("tokenizer.ggml.add_space_prefix", True))
        add_bos_default = True
    else:
        raise ValueError(f"GGUF file {str(gguf.path)!r} has a {kind!r} vocabulary; infer builds "
                         "'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies")
    ids = {key: gguf.get(f"tokenizer.ggml.{name}") for key, name in SPECIAL_KEYS.items()}
    strings = {key: None if token_id is None else tokens[token_id] for key, token_id in ids.items()}
    template = gguf.get("tokenizer.chat_template")
    if template is None and set(LLAMA3_HEADER_TOKENS) <= set(tokens):  # as for a directory
        template = LLAMA3_CHAT_TEMPLATE
    return Tokenizer(HFTokenizersBackend(tok), name_or_path=str(gguf.path), token_strings=strings,
                     extra_eos_ids=stop_token_ids(gguf), chat_template=template,
                     add_bos_token=gguf.get("tokenizer.ggml.add_bos_token", add_bos_default),
                     add_eos_token=gguf.get("tokenizer.ggml.add_eos_token", False))


def byte_level_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                   pre: str) -> tokenizers.Tokenizer:
    """Byte-level BPE over the file's vocabulary (already in GPT-2's byte alphabet)."""
    split = PRE_TOKENIZERS[pre]
    pairs = [_merge_pair(merge) for merge in merges]
    model = models.BPE(vocab=_vocab(tokens), merges=pairs, ignore_merges=split.ignore_merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, types)
    return tok


def sentencepiece_bpe(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float],
                      add_space_prefix: bool) -> tokenizers.Tokenizer:
    """SentencePiece BPE: merges ranked by the merged piece's score, byte fallback."""
    unk = next((t for t, kind in zip(tokens, types, strict=True) if kind == TokenType.UNKNOWN), None)
    model = models.BPE(vocab=_vocab(tokens), merges=spm_merges(tokens, types, scores),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(model)
    spaces = normalizers.Replace(" ", SPACE)
    prefixed = normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
    tok.normalizer = prefixed if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    _add_tokens(tok, tokens, types)
    return tok


def spm_merges(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a normal piece into two
    pieces of the vocabulary, best merged-piece score first (ties: vocabulary order)."""
    ids = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == TokenType.NORMAL}
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[piece_id], ids[left], ids[right], (left, right)))
    return [pair for *_, pair in sorted(ranked)]


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        duplicate = next(t for t, n in Counter(tokens).items() if n > 1)
        raise ValueError(f"the GGUF vocabulary lists the token {duplicate!r} twice; one string "
                         "cannot have two ids here: the file's tokenizer metadata is corrupt")
    return vocab


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"GGUF merge {merge!r} is not two tokens separated by a space")
    return left, right


def _add_tokens(tok: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain ones."""
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=True) if kind == TokenType.USER_DEFINED])

