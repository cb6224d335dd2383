"""Structured outputs: grammars compiled with xgrammar, one matcher per request, and the
token masks that restrict the model's logits to what the grammar allows.

`Grammars` (one per engine) compiles and caches grammars and gives each request a
`RequestGrammar`. Imported only for structured outputs. docs/architecture.md, "Structured outputs".
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from infer.sampling import StructuredOutput
from infer.tokenization import Tokenizer

DEFAULT_CACHE_BYTES = 256 * 2**20  # compiled grammars kept per engine, by their xgrammar memory size
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:line: " before xgrammar's message


def token_bytes_table(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of each id in [0, vocab_size) for xgrammar (b"" for special and missing ids:
    never emitted). Byte-level BPE and SentencePiece pieces are read; ValueError for other vocabularies."""
    table: list[bytes] = []
    readable = 0
    for token_id in range(vocab_size):
        raw = tokenizer.token_bytes(token_id) if token_id < tokenizer.vocab_size else None
        if raw is None and token_id < tokenizer.vocab_size and not tokenizer.is_special(token_id):
            raw = _sentencepiece_bytes(tokenizer.convert_ids_to_tokens(token_id))
        readable += raw is not None
        table.append(raw or b"")
    if readable < vocab_size // 2:
        raise ValueError(f"structured outputs need a byte-level BPE or SentencePiece vocabulary; the tokenizer "
                         f"{tokenizer.name_or_path!r} gives bytes for only {readable} of {vocab_size} tokens")
    return table


def _sentencepiece_bytes(piece: str) -> bytes | None:
    if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class RequestGrammar:
    """One request's grammar state (an xgrammar matcher)."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> None:
        """Advance over an emitted token (one the mask allowed)."""
        if not self._matcher.accept_token(int(token_id)):
            raise RuntimeError(f"token {token_id} was emitted but the grammar does not allow it here")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the mask of the next token at the current state into bitmask[row]."""
        if self._matcher.is_terminated():
            bitmask[row] = -1  # nothing follows: any row will do (it is never sampled)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_after(self, bitmask: torch.Tensor, row: int, path: Sequence[int]) -> None:
        """Write the mask of the token after `path` (draft tokens from the current state) into
        bitmask[row], then roll back; a path the grammar refuses leaves its row all-allowed."""
        taken = 0
        for token_id in path:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token_id)):
                break
            taken += 1
        if taken == len(path):
            self.fill(bitmask, row)
        else:
            bitmask[row] = -1
        if taken:
            self._matcher.rollback(taken)


class GrammarCache:
    """Compiled grammars by spec, least recently used dropped once their memory passes
    `max_bytes` (a larger grammar is not kept). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"a grammar cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[StructuredOutput, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: StructuredOutput) -> xgr.CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(spec)
            if entry is None:
                return None
            self._entries.move_to_end(spec)
            return entry[0]

    def put(self, spec: StructuredOutput, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            if spec in self._entries or size > self.max_bytes:
                return
            self._entries[spec] = (compiled, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped


def tokenizer_info(token_table: list[bytes], vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(token_table, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


def new_compiler(info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    """One compiling thread, no cache of xgrammar's own (ours is bounded in bytes)."""
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_checked(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    """`spec` compiled; ValueError naming the problem when it is invalid or accepts no string
    (no token allowed at its start: `root ::= root`), MemoryError when the compile ran out of
    memory. A grammar that dead-ends only after some output fails its request in the engine."""
    try:
        compiled = _compile(compiler, spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
        message = _XGR_PREFIX.sub("", str(exc)).strip()
        if "bad_alloc" in message:
            raise MemoryError(f"compiling this {spec.kind} grammar ran out of memory") from None
        raise ValueError(f"invalid structured output ({spec.kind}): {message}") from None
    vocab_size = compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise ValueError(f"invalid structured output ({spec.kind}): it accepts no string (no token can start "
                         "it and it is not complete): give a grammar that some text matches")
    return compiled


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
    if spec.json is not None:
        return compiler.compile_json_schema(spec.json, any_whitespace=False)
    if spec.json_object:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.regex is not None:
        return compiler.compile_regex(spec.regex)
    if spec.choice is not None:
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)  # EBNF string literals
        return compiler.compile_grammar(f"root ::= {literals}")
    assert spec.grammar is not None
    return compiler.compile_grammar(spec.grammar)


class Grammars:
    """Compiles structured-output specs against one tokenizer (cached per spec) and makes each
    request's `RequestGrammar`; `token_table` and `info` let a worker process compile for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.token_table = token_bytes_table(tokenizer, vocab_size)
        self.info = tokenizer_info(self.token_table, vocab_size, self.eos_token_ids)
        self._compiler = new_compiler(self.info)
        self.cache = GrammarCache(cache_bytes)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming the problem when it is invalid."""
        compiled = self.cache.get(spec)
        if compiled is None:
            compiled = compile_checked(self._compiler, spec)
            self.cache.put(spec, compiled)
        return compiled

    def load(self, serialized: str) -> xgr.CompiledGrammar:
        """A grammar a worker compiled (`CompiledGrammar.serialize_json`) for this tokenizer."""
        return xgr.CompiledGrammar.deserialize_json(serialized, self.info)

    def matcher(self, spec: StructuredOutput, compiled: xgr.CompiledGrammar | None = None) -> RequestGrammar:
        """A fresh grammar state for one request, of `compiled` or, when None, of spec compiled here."""
        return RequestGrammar(xgr.GrammarMatcher(compiled or self.compile(spec)), self.vocab_size)
