"""Structured outputs: grammars compiled with xgrammar, one matcher per request, and the
token masks that restrict the model's logits to what the grammar allows.

`Grammars` (one per engine) turns a `StructuredOutput` into an xgrammar `CompiledGrammar`
against the engine's tokenizer, cached per spec, and gives each request a `RequestGrammar`.
A `RequestGrammar` advances over every emitted token and fills the mask of the tokens that
may come next: at its current state, or (for a speculation round) at the state after a
draft node's path, by advancing over the path, filling, and rolling back.

Masks are xgrammar's packed bitmasks, applied by `speculative.grammar_mask` (which needs no
xgrammar: the runner imports it, this module is imported only when a request asks for a
structured output). Tokens the tokenizer does not cover (a model vocabulary padded past
it) are never allowed.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from infer.sampling import StructuredOutput
from infer.tokenization import Tokenizer

_CACHE_SIZE = 256  # compiled grammars kept per engine
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:line: " before xgrammar's message


def token_bytes_table(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of each id in [0, vocab_size) for xgrammar (b"" for special tokens and ids
    the tokenizer lacks: xgrammar never lets a grammar emit those). Byte-level BPE tokens
    map through GPT-2's byte alphabet; SentencePiece pieces ("▁hi", "<0x0A>") are read too."""
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
        """Write the mask of the token after `path` (draft tokens from the current state)
        into bitmask[row], then roll back. A path the grammar refuses leads to a node the
        verifier rejects (its token has target probability 0), so its row is left all-allowed."""
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


class Grammars:
    """Compiles structured-output specs against one tokenizer (cached per spec) and makes
    each request's `RequestGrammar`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(token_bytes_table(tokenizer, vocab_size), xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming the problem when it is invalid."""
        if spec in self._cache:
            self._cache.move_to_end(spec)
            return self._cache[spec]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
            message = _XGR_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"invalid structured output ({spec.kind}): {message}") from None
        self._cache[spec] = compiled
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        if spec.json is not None:
            return self._compiler.compile_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return self._compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)  # EBNF string literals
            return self._compiler.compile_grammar(f"root ::= {literals}")
        assert spec.grammar is not None
        return self._compiler.compile_grammar(spec.grammar)

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh grammar state for one request."""
        return RequestGrammar(xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)
