"""Prompt lookup draft table, one per request, pure Python (proposer: `infer.speculative.ngram`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from infer.speculative.ngram_tables import NgramConfig, TokenWindow
from infer.speculative.tree import Draft, TreeShape, fill_tree


class PromptLookupTable:
    """Prompt lookup: copy what followed the most recent earlier occurrence of the longest suffix."""

    def __init__(self, max_order: int = 4, min_order: int = 2, window: int = 512) -> None:
        NgramConfig("prompt_lookup", max_order, min_order, window)  # validates the arguments
        self.max_order, self.min_order = max_order, min_order
        self._ctx_lens = range(max_order - 1, min_order - 2, -1)  # longest first
        self._win = TokenWindow(window)
        # per length c: c-token sequence -> absolute position of the token after its latest occurrence
        self._index: dict[int, dict[tuple[int, ...], int]] = {c: {} for c in self._ctx_lens}

    @property
    def history(self) -> list[int]:
        """The windowed tokens the index is built from (a copy)."""
        return self._win.tokens()

    def extend(self, tokens: Iterable[int]) -> None:
        """Add tokens the request really has and forget occurrences that leave the window."""
        win = self._win
        for token in tokens:
            pos = win.end
            win.append(token)
            for c in self._ctx_lens:
                if pos - c >= win.start:
                    self._index[c][tuple(win.slice(pos - c, pos))] = pos
            if len(win) > win.size:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        """Forget occurrences that start at the oldest window position, then drop it."""
        win = self._win
        q = win.start
        for c in self._ctx_lens:
            key = tuple(win.slice(q, q + c))
            if q + c < win.end and self._index[c].get(key) == q + c:
                del self._index[c][key]  # only if no newer occurrence replaced it
        win.drop_oldest()

    def find(self, context: Sequence[int]) -> tuple[int, int] | None:
        """(suffix length, absolute start of the copied continuation) of the best match, or None."""
        n = len(context)
        for c in self._ctx_lens:
            if n >= c:
                pos = self._index[c].get(tuple(context[n - c :]))
                if pos is not None:
                    return c, pos
        return None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens copied from the history; re-matches when a copy runs off its end."""
        tail = list(history[-(self.max_order - 1) :])
        draft: list[int] = []
        while len(draft) < k:
            match = self.find(tail)
            if match is None:
                break
            start = match[1]
            span = self._win.slice(start, min(start + k - len(draft), self._win.end))
            draft.extend(span)  # non-empty: an indexed follower is inside the window
            tail = (tail + span)[-(self.max_order - 1) :]
        return draft

    def top_continuations(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n distinct next tokens for `context`, best first: what followed the latest occurrence
        of its suffix of each length, longest first (the first is `find`'s). Read-only."""
        picked: list[int] = []
        m = len(context)
        for c in self._ctx_lens:
            pos = self._index[c].get(tuple(context[m - c:])) if m >= c and len(picked) < n else None
            if pos is None:
                continue
            token = self._win.slice(pos, pos + 1)[0]  # an indexed follower is inside the window
            if token not in picked:
                picked.append(token)
        return picked

    def propose_tree(self, history: Sequence[int], shape: TreeShape) -> Draft:
        """A deterministic tree after `history` (`fill_tree`); read-only. Each node matches afresh, so
        its first-child path may differ from `propose`'s."""
        return fill_tree(self, history, shape)
