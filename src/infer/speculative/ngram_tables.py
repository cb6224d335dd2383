"""N-gram draft tables, one per request, pure Python: `NgramTable` (frequency tables over a
sliding window), `NgramConfig`, `TokenWindow` and the `DraftTable` protocol; the proposer is
`infer.speculative.ngram`. docs/speculation.md, "N-gram tables and prompt lookup".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from infer.sampling import is_strict_int
from infer.speculative.tree import Draft, TreeShape, fill_tree

METHODS = ("ngram", "prompt_lookup")


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """Which table to draft from and its shape (orders are n-gram lengths: context + 1)."""

    method: str = "ngram"  # "ngram" (frequency tables) or "prompt_lookup" (copy earlier span)
    max_order: int = 4  # longest n-gram: contexts of up to max_order - 1 tokens
    min_order: int = 2  # shortest n-gram: contexts of at least min_order - 1 tokens
    window: int = 512  # only n-grams inside the last `window` tokens are counted

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not is_strict_int(self.min_order) or self.min_order < 2:
            raise ValueError(
                f"min_order must be an integer >= 2 (a context of at least one token), got {self.min_order!r}"
            )
        if not is_strict_int(self.max_order) or self.max_order < self.min_order:
            raise ValueError(
                f"max_order must be an integer >= min_order ({self.min_order}), got {self.max_order!r}"
            )
        if not is_strict_int(self.window) or self.window < self.max_order:
            raise ValueError(
                f"window must be an integer >= max_order ({self.max_order}) so that an n-gram "
                f"fits in it, got {self.window!r}"
            )


class TokenWindow:
    """The last `size` tokens, addressed by absolute position (0 = first token ever added)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._tokens: list[int] = []
        self._base = 0  # absolute position of self._tokens[0]
        self.start = 0  # absolute position of the oldest token still in the window

    @property
    def end(self) -> int:
        """Absolute position one past the newest token."""
        return self._base + len(self._tokens)

    def __len__(self) -> int:
        return self.end - self.start

    def append(self, token: int) -> None:
        self._tokens.append(token)

    def extend(self, tokens: list[int]) -> None:
        self._tokens.extend(tokens)

    def drop_oldest(self) -> None:
        self.start += 1
        if self.start - self._base >= self.size:  # compact: amortised O(1) per token
            del self._tokens[: self.start - self._base]
            self._base = self.start

    def slice(self, lo: int, hi: int) -> list[int]:
        """Tokens at absolute positions [lo, hi) (both inside the window)."""
        return self._tokens[lo - self._base : hi - self._base]

    def tokens(self) -> list[int]:
        return self._tokens[self.start - self._base :]


# A continuation's count and newest position packed in one int, count * _ONE + position: ordered
# by count, then recency (`predict`'s tie rule), and nothing for the garbage collector to scan.
_POS_BITS = 40
_ONE = 1 << _POS_BITS
_POS_MASK = _ONE - 1

# one level: (c, context -> {next token: packed}, context -> best next token (absent when stale))
_Level = tuple[int, dict[tuple[int, ...], dict[int, int]], dict[tuple[int, ...], int]]

# an extension of at least this many tokens that evicts nothing goes level by level (`_extend_levels`)
_BULK_MIN = 16


class NgramTable:
    """Per-request n-gram frequency tables over a sliding window of tokens."""

    def __init__(self, max_order: int = 4, min_order: int = 2, window: int = 512) -> None:
        NgramConfig("ngram", max_order, min_order, window)  # validates the arguments
        self.max_order, self.min_order = max_order, min_order
        self._max_ctx = max_order - 1
        self._win = TokenWindow(window)
        # (context length c, its table, its best continuations), longest context first
        self._levels: list[_Level] = [(c, {}, {}) for c in range(max_order - 1, min_order - 2, -1)]
        self._tail: tuple[int, ...] = ()  # the last (up to) max_order - 1 tokens

    @property
    def history(self) -> list[int]:
        """The windowed tokens the tables are built from (a copy)."""
        return self._win.tokens()

    def extend(self, tokens: Iterable[int]) -> None:
        """Add tokens the request really has (never drafts) and evict what leaves the window."""
        if not isinstance(tokens, list):
            tokens = list(tokens)
        if len(tokens) >= _BULK_MIN:  # (a few tokens, the usual catch-up, skip the check)
            room = self._win.size - len(self._win)
            if room >= _BULK_MIN:
                self._extend_levels(tokens[:room])
                tokens = tokens[room:]
        self._extend_each(tokens)

    def _extend_levels(self, tokens: list[int]) -> None:
        """`extend` with tokens that all fit in the window: each level on its own, the same tables
        as token by token."""
        win, max_ctx = self._win, self._max_ctx
        seq = [*self._tail, *tokens]
        base, end = len(self._tail), len(seq)
        one, high = _ONE, ~_POS_MASK
        for c, table, best in self._levels:
            first = max(base, c)  # the first new token with c tokens of context before it
            if first >= end:
                continue
            get, best_get = table.get, best.get
            pos = win.end + first - base
            contexts = zip(*(seq[first - c + i:end - c + i] for i in range(c)))
            for ctx, token in zip(contexts, seq[first:]):
                conts = get(ctx)
                if conts is None:
                    table[ctx] = {token: one + pos}
                    best[ctx] = token
                else:
                    packed = (conts.get(token, 0) & high) + one + pos
                    conts[token] = packed
                    top = best_get(ctx)
                    if top is not None and packed > conts[top]:
                        best[ctx] = token
                pos += 1
        win.extend(tokens)
        self._tail = tuple(seq[-max_ctx:])

    def _extend_each(self, tokens: list[int]) -> None:
        """`extend` token by token, evicting the oldest n-grams as the window slides."""
        win, levels, max_ctx = self._win, self._levels, self._max_ctx
        tail, size, pos = self._tail, win.size, win.end
        for token in tokens:
            r = len(tail)  # the context before `token`: always inside the window (max_ctx < size)
            for c, table, best in levels:
                if c > r:
                    continue
                ctx = tail[r - c:]
                conts = table.get(ctx)
                if conts is None:
                    table[ctx] = {token: _ONE + pos}
                    best[ctx] = token
                    continue
                packed = (conts.get(token, 0) & ~_POS_MASK) + _ONE + pos
                conts[token] = packed
                top = best.get(ctx)
                # the newest occurrence wins ties: it becomes best once its count reaches the best's
                if top is not None and packed > conts[top]:
                    best[ctx] = token
            win.append(token)
            pos += 1
            tail = (tail + (token,))[-max_ctx:]
            if pos - win.start > size:
                self._evict_oldest()
        self._tail = tail

    def _evict_oldest(self) -> None:
        """Remove the n-grams that start at the oldest window position, then drop it."""
        win = self._win
        q = win.start
        oldest = tuple(win.slice(q, q + self._max_ctx + 1))  # the window holds more than max_ctx + 1
        for c, table, best in self._levels:
            ctx, token = oldest[:c], oldest[c]
            conts = table[ctx]
            packed = conts[token] - _ONE
            if packed >= _ONE:
                conts[token] = packed
            elif len(conts) > 1:
                del conts[token]
            else:
                del table[ctx]
                best.pop(ctx, None)
                continue
            if best.get(ctx) == token:
                del best[ctx]
        win.drop_oldest()

    def predict(self, context: Sequence[int]) -> int | None:
        """Most frequent continuation of the longest known suffix of `context`, or None."""
        n = len(context)
        for c, table, best in self._levels:
            if n >= c:
                ctx = tuple(context[n - c:])
                conts = table.get(ctx)
                if conts is not None:
                    top = best.get(ctx)
                    if top is None:
                        top = best[ctx] = max(conts, key=conts.__getitem__)
                    return top
        return None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Chain up to k predictions after `history`; the table is not modified."""
        context = list(history[-(self.max_order - 1) :])
        draft: list[int] = []
        for _ in range(k):
            token = self.predict(context)
            if token is None:
                break
            draft.append(token)
            context = (context + [token])[-(self.max_order - 1) :]
        return draft

    def top_continuations(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n distinct next tokens for `context`, best first (the first is `predict`'s): the
        longest known suffix's by count then recency, then shorter suffixes'. Read-only."""
        picked: list[int] = []
        m = len(context)
        for c, table, _ in self._levels:
            conts = table.get(tuple(context[m - c:])) if m >= c and len(picked) < n else None
            if conts is None:
                continue
            # n of them are enough: at most len(picked) are listed already
            for token in heapq.nlargest(n, conts, key=conts.__getitem__):
                if token not in picked and len(picked) < n:
                    picked.append(token)
        return picked

    def propose_tree(self, history: Sequence[int], shape: TreeShape) -> Draft:
        """A deterministic tree after `history` (`fill_tree`), first-child path `propose`'s; read-only."""
        return fill_tree(self, history, shape)

    def continuations(self, context: Sequence[int]) -> dict[int, int]:
        """Next-token counts for exactly this context (empty if unseen or of unused length)."""
        for c, table, _ in self._levels:
            conts = table.get(tuple(context)) if c == len(context) else None
            if conts is not None:
                return {tok: packed >> _POS_BITS for tok, packed in conts.items()}
        return {}

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every counted n-gram (context + next token) with its count, over all orders."""
        return {
            ctx + (tok,): packed >> _POS_BITS
            for _, table, _ in self._levels
            for ctx, conts in table.items()
            for tok, packed in conts.items()
        }


class DraftTable(Protocol):
    """What NgramProposer needs of a per-request table (NgramTable, PromptLookupTable)."""

    @property
    def history(self) -> list[int]: ...

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...

    def top_continuations(self, context: Sequence[int], n: int) -> list[int]: ...

    def propose_tree(self, history: Sequence[int], shape: TreeShape) -> Draft: ...
