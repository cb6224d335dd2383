"""Tokenizer backends: `tokenizers` (tokenizer.json) and tiktoken (Llama 3 tokenizer.model).

Both expose `TokenizerBackend`: raw encode/decode, token <-> id lookup, special ids; config files (BOS policy, eos
ids, template) are `Tokenizer`'s. The tiktoken backend rebuilds Meta's Llama 3 tokenizer (ranks, pre-tokenizer
regex, 256 specials as `llama_models` orders them), with GPT-2 byte-alphabet token strings as in tokenizer.json
(" hello" -> "Ġhello")."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import tiktoken
import tokenizers

# Llama 3 pre-tokenizer: contractions, words, 1-3 digit groups, punctuation runs, newlines, spaces
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>",
    "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
)
# tiktoken's regex engine can fail on very long inputs or runs: `split_for_tiktoken` cuts them
TIKTOKEN_MAX_CHARS = 400_000
TIKTOKEN_MAX_RUN = 25_000
_RUNS = re.compile(r"\s+|\S+")
METASPACE = "\u2581"  # SentencePiece's space


class TokenLimitExceeded(ValueError):
    """Raised by `encode(..., limit=N)` for a text of more than N tokens (`count` of them)."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"the text has {count} tokens, more than the limit of {limit}")
        self.count = count


class TokenizerBackend(Protocol):
    """The raw tokenization surface both backends provide."""

    name: str
    vocab_size: int  # full id space, special tokens included

    def encode(self, text: str, add_special_tokens: bool, parse_special: bool = True,
               limit: int | None = None) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def special_ids(self) -> frozenset[int]: ...
    def token_form(self) -> str | None:
        """How vocabulary strings spell bytes: "byte_level", "metaspace" or None (unknown)."""
        ...
    def added_contents(self) -> dict[int, str]:
        """The text of each added token that is not special (stored as text, not in the form)."""
        ...


class HFTokenizersBackend:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json. `parse_special=False` uses a second
    copy with `encode_special_tokens` set (no race between modes); `encode_batch_fast` releases the GIL."""

    name = "tokenizers"

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tok = tokenizer
        self._plain: tokenizers.Tokenizer | None = None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        self._special = frozenset(token_id for token_id, added
                                  in tokenizer.get_added_tokens_decoder().items() if added.special)

    @classmethod
    def from_file(cls, path: Path) -> HFTokenizersBackend:
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"could not load {path} with the tokenizers library: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool, parse_special: bool = True,
               limit: int | None = None) -> list[int]:
        tok = self._tok if parse_special else self._plain_tokenizer()
        encoding = tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:  # checked before the id list is built
            raise TokenLimitExceeded(len(encoding), limit)
        return encoding.ids

    def _plain_tokenizer(self) -> tokenizers.Tokenizer:
        if self._plain is None:  # (two threads may both build one: harmless, one is kept)
            plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def special_ids(self) -> frozenset[int]:
        return self._special

    def token_form(self) -> str | None:
        decoder = self._tok.decoder
        return decoder_form(None if decoder is None else decoder.__getstate__())

    def added_contents(self) -> dict[int, str]:
        return {token_id: added.content for token_id, added in self._tok.get_added_tokens_decoder().items()
                if not added.special}


class TiktokenBackend:
    """Meta's Llama 3 tokenizer.model (tiktoken BPE ranks) plus the 256 Llama 3 specials."""

    name = "tiktoken"

    def __init__(self, ranks: dict[bytes, int], encoding_name: str = "llama3") -> None:
        num_base = len(ranks)
        names = llama3_special_token_names()
        self.special_tokens = {token: num_base + i for i, token in enumerate(names)}
        self._encoding = tiktoken.Encoding(name=encoding_name, pat_str=LLAMA3_PATTERN,
                                           mergeable_ranks=ranks,
                                           special_tokens=self.special_tokens)
        self._ranks = ranks
        self._special_names = {token_id: token for token, token_id in self.special_tokens.items()}
        self._special = frozenset(self._special_names)
        self.vocab_size = num_base + len(names)
        self.bos_token_id = self.special_tokens["<|begin_of_text|>"]

    @classmethod
    def from_file(cls, path: Path) -> TiktokenBackend:
        return cls(load_tiktoken_ranks(path), encoding_name=path.name)

    def encode(self, text: str, add_special_tokens: bool, parse_special: bool = True,
               limit: int | None = None) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        allowed: str | set[str] = "all" if parse_special else set()
        for piece in split_for_tiktoken(text, TIKTOKEN_MAX_CHARS, TIKTOKEN_MAX_RUN):
            ids.extend(self._encoding.encode(piece, allowed_special=allowed, disallowed_special=()))
        if limit is not None and len(ids) > limit:
            raise TokenLimitExceeded(len(ids), limit)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
        return self._encoding.decode(list(ids), errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        raw = byte_level_bytes(token)
        return None if raw is None else self._ranks.get(raw)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_names:
            return self._special_names[token_id]
        if not 0 <= token_id < self.vocab_size:
            return None
        encoder = _byte_to_unicode()
        return "".join(encoder[b] for b in self._encoding.decode_single_token_bytes(token_id))

    def special_ids(self) -> frozenset[int]:
        return self._special

    def token_form(self) -> str | None:
        return "byte_level"  # (`id_to_token` writes GPT-2's byte alphabet)

    def added_contents(self) -> dict[int, str]:
        return {}


def decoder_form(decoder_json: str | bytes | None) -> str | None:
    """The form of a tokenizer.json decoder (its JSON): "byte_level" (a ByteLevel step),
    "metaspace" (Metaspace, ByteFallback or a Replace of "▁"), else None."""
    if decoder_json is None:
        return None
    steps: list[dict[str, object]] = []
    todo = [json.loads(decoder_json)]
    while todo:
        step = todo.pop()
        if isinstance(step, dict):
            steps.append(step)
            todo.extend(step.get("decoders") or [])
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return "byte_level"
    replaces_space = any(step.get("type") == "Replace" and METASPACE in json.dumps(step.get("pattern"))
                         for step in steps)
    return "metaspace" if types & {"Metaspace", "ByteFallback"} or replaces_space else None


def llama3_special_token_names() -> list[str]:
    """The 256 Llama 3 special tokens in id order (named ones, then reserved_2..)."""
    num_reserved = LLAMA3_NUM_SPECIAL_TOKENS - len(LLAMA3_NAMED_SPECIAL_TOKENS)
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(num_reserved)]
    return [*LLAMA3_NAMED_SPECIAL_TOKENS, *reserved]


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one `<base64 token> <rank>` pair per line."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(
                f"{path} line {number} is not '<base64 token> <rank>' ({exc}); only Llama 3 "
                "tiktoken tokenizer.model files are supported (SentencePiece models need "
                "their tokenizer.json)") from exc
    if not ranks:
        raise ValueError(f"{path} holds no BPE ranks; it is not a tiktoken tokenizer.model "
                         "(SentencePiece models need their tokenizer.json)")
    return ranks


def split_for_tiktoken(text: str, max_chars: int, max_run: int) -> list[str]:
    """Cut `text` into pieces of <= max_chars with no (non-)whitespace run over max_run. Cuts
    fall at run starts, so ordinary text tokenizes as in one piece; only long runs are cut inside."""
    if len(text) <= max_chars and not _has_long_run(text, max_run):
        return [text]
    cuts = [0]
    for match in _RUNS.finditer(text):
        start, end = match.span()
        if end - start > max_run:
            cuts.extend(range(start, end, max_run))
        elif end - cuts[-1] > max_chars:
            cuts.append(start)
    bounds = sorted(set(cuts)) + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _has_long_run(text: str, max_run: int) -> bool:
    if len(text) <= max_run:
        return False
    return re.search(rf"\s{{{max_run + 1},}}|\S{{{max_run + 1},}}", text) is not None


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def byte_level_bytes(token: str) -> bytes | None:
    """The bytes of a byte-level vocabulary string ("Ġhi" -> b" hi"); None outside GPT-2's alphabet."""
    decoder = _unicode_to_byte()
    if not all(ch in decoder for ch in token):
        return None
    return bytes(decoder[ch] for ch in token)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in _byte_to_unicode().items()}
