"""Streaming detokenization: turn generated ids into text deltas one token at a time.

`IncrementalDetokenizer` decodes a small window of recent tokens twice (prefix / read offsets)
and emits the difference, held back while it ends in an unfinished character (U+FFFD); the
concatenated deltas equal decode(generated ids). docs/architecture.md, "Tokenization".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context (enough for leading-space handling).
PROMPT_CONTEXT_TOKENS = 5
# Drop consumed ids from the buffer once this many sit before the window.
_COMPACT_AFTER = 256


class Decoder(Protocol):
    """Anything with the `Tokenizer.decode` signature."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Per-request streaming decoder: `push(id)` returns the text that became final."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes of an unfinished character excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly final text ("" while a character is open)."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is still held back (at the end of generation), even if incomplete."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text):
            self._read_offset = len(self._ids)
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._pieces.append(delta)
        self._compact()
        return delta

    def _compact(self) -> None:
        """Forget ids that precede the window so memory stays bounded on long generations."""
        if self._prefix_offset < _COMPACT_AFTER:
            return
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end],
                                      skip_special_tokens=self._skip_special_tokens)
