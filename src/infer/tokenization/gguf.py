"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library.

`read_gguf_tokenizer(path)` reads the metadata only (before any weight loads) into a
`GGUFTokenizer`. Vocabulary kinds, as llama.cpp runs them: "gpt2" (`byte_level_bpe`, with the
named pre-tokenizer) and "llama" (`sentencepiece_bpe`, merges from scores). docs/architecture.md.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, decoders, models, normalizers

from infer.models.loading.gguf.config import stop_token_ids
from infer.models.loading.gguf.reader import GGUFFile
from infer.tokenization.backends import HFTokenizersBackend
from infer.tokenization.chat import LLAMA3_CHAT_TEMPLATE, LLAMA3_HEADER_TOKENS
from infer.tokenization.pretokenizers import PRE_TOKENIZERS

SPACE = "▁"  # SentencePiece's visible space
SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
WORKAROUND = ("pass the model's tokenizer instead: a directory with its tokenizer.json "
              "(`--tokenizer DIR`, or `LLM(..., tokenizer=DIR)`)")


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """What a `Tokenizer` is built from, as a GGUF file's metadata gives it."""

    backend: HFTokenizersBackend
    token_strings: Mapping[str, str | None]  # "bos_token", "eos_token", ... -> vocabulary string
    eos_token_ids: tuple[int, ...]  # every id generation stops on
    chat_template: str | None
    add_bos_token: bool
    add_eos_token: bool


def read_gguf_tokenizer(path: str | os.PathLike[str]) -> GGUFTokenizer:
    """The tokenizer of a GGUF file; ValueError for a vocabulary infer cannot rebuild exactly."""
    gguf = GGUFFile.open(path)
    tokens: list[str] = gguf.value("tokenizer.ggml.tokens")
    types: list[int] = gguf.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    kind = gguf.value("tokenizer.ggml.model")
    if kind == "gpt2":
        pre = _pre_tokenizer_name(gguf)
        tok = byte_level_bpe(tokens, types, gguf.value("tokenizer.ggml.merges"), pre)
        add_bos_default = PRE_TOKENIZERS[pre].add_bos
    elif kind == "llama":
        tok = sentencepiece_bpe(tokens, types, gguf.value("tokenizer.ggml.scores"),
                                gguf.get("tokenizer.ggml.add_space_prefix", True))
        add_bos_default = True
    else:
        raise ValueError(f"GGUF file {str(gguf.path)!r} has a {kind!r} vocabulary; infer builds "
                         f"'gpt2' (byte-level BPE) and 'llama' (SentencePiece) vocabularies: {WORKAROUND}")
    ids = {key: gguf.get(f"tokenizer.ggml.{name}") for key, name in SPECIAL_KEYS.items()}
    strings = {key: None if token_id is None else tokens[token_id] for key, token_id in ids.items()}
    template = gguf.get("tokenizer.chat_template")
    if template is None and set(LLAMA3_HEADER_TOKENS) <= set(tokens):  # as for a directory
        template = LLAMA3_CHAT_TEMPLATE
    return GGUFTokenizer(HFTokenizersBackend(tok), token_strings=strings, eos_token_ids=stop_token_ids(gguf),
                         chat_template=template,
                         add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                         add_eos_token=bool(gguf.get("tokenizer.ggml.add_eos_token", False)))


def _pre_tokenizer_name(gguf: GGUFFile) -> str:
    """`tokenizer.ggml.pre`, checked against the pre-tokenizers infer implements."""
    pre = gguf.get("tokenizer.ggml.pre")
    if pre is None:
        raise ValueError(
            f"GGUF file {str(gguf.path)!r} does not name its pre-tokenizer (tokenizer.ggml.pre): "
            f"it was converted by a llama.cpp older than the pre-tokenizer names, and how it splits "
            f"text is unknown; {WORKAROUND}, or convert the model again with a current llama.cpp")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF file {str(gguf.path)!r} names the pre-tokenizer {pre!r}, which infer does not "
            f"implement (it implements {', '.join(sorted(PRE_TOKENIZERS))}); {WORKAROUND}")
    return pre


def byte_level_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                   pre: str) -> tokenizers.Tokenizer:
    """Byte-level BPE over the file's (GPT-2 alphabet) vocabulary, cut by `PRE_TOKENIZERS[pre]`."""
    rules = PRE_TOKENIZERS[pre]
    pairs = [_merge_pair(merge) for merge in merges]
    model = models.BPE(vocab=_vocab(tokens), merges=pairs, ignore_merges=rules.ignore_merges)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = rules.pre_tokenizer()
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
    """BPE merges a SentencePiece vocabulary implies: every split of a normal piece into two known
    pieces, best merged-piece score first (ties: vocabulary order)."""
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

