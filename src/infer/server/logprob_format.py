"""Log-probabilities (`infer.logprobs.TokenLogprobs`) in OpenAI's two response formats.

Completions (legacy): parallel lists per token; chat: one {token, logprob, bytes, top_logprobs}
entry per token. As OpenAI does, a token holding part of a UTF-8 character shows as
`bytes:\\xNN...`, and log-probabilities below -9999 (or -inf) as -9999.0.
"""

from __future__ import annotations

from collections.abc import Sequence

from infer.logprobs import TokenLogprobs
from infer.server.responses import ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from infer.tokenization import Tokenizer

FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > FLOOR else FLOOR


class LogprobFormatter:
    """Turns token ids into the strings and bytes the formats show (cached per id)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def token(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self._lookup(token_id)[1])

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._describe(token_id)
            if len(self._cache) < 65536:
                self._cache[token_id] = found
        return found

    def _describe(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, text.encode()
        raw = self.tokenizer.token_bytes(token_id)
        if raw is None:
            text = self.tokenizer.decode([token_id])
            return text, text.encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def completion(self, entries: Sequence[TokenLogprobs], offset: int, with_top: bool) -> CompletionLogprobs:
        """Entries of consecutive tokens whose text starts at character `offset`."""
        tokens = [self.token(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = [{self.token(t): _lp(v) for t, v in e.top} for e in entries] if with_top else None
        return CompletionLogprobs(tokens=tokens, token_logprobs=[_lp(e.logprob) for e in entries],
                                  top_logprobs=top, text_offset=offsets)

    def chat(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for e in entries:
            top = [self._top(t, v) for t, v in e.top]
            content.append(ChatTokenLogprob(token=self.token(e.token_id), logprob=_lp(e.logprob),
                                            bytes=self.token_bytes(e.token_id), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=self.token(token_id), logprob=_lp(logprob), bytes=self.token_bytes(token_id))
