"""A suffix trie of bounded depth over token sequences, updated token by token: what suffix
decoding drafts from (SuffixDecoding, arXiv 2411.04975, section 3). `SuffixTrie` counts every
substring of up to D tokens (`extend`, `remove`: O(D) a token); `SuffixCache` holds at most N
tokens, the oldest evicted. Layout and costs: docs/speculation.md, "Suffix decoding".
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence

_SHIFT = 32  # a tail: sequence id << _SHIFT | the position in it after the tail's string
_LOW = (1 << _SHIFT) - 1
ROOT = ~0  # the root's position (a node's position is ~its id)

Position = int  # where a string ends: ~node id (< 0), or a place in a tail (>= 0)


class _Live:
    """A growing sequence's suffixes shorter than D, each [start, deepest node id on its path, that
    node's depth]: `active` ones end at their node, `dormant` ones (by start) run on in their own
    tail until another occurrence splits it (`SuffixTrie._split`)."""

    __slots__ = ("active", "dormant")

    def __init__(self) -> None:
        self.active: list[list[int]] = []
        self.dormant: dict[int, list[int]] = {}


class SuffixTrie:
    """Counts of every substring of length <= max_depth of the sequences added; a string seen once
    is a tail (an int `seq << 32 | end`) into the stored text, nodes are ints (`~id`)."""

    def __init__(self, max_depth: int) -> None:
        if not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1, got {max_depth!r}")
        self.max_depth = max_depth
        self._count: list[int] = [0]  # node id -> occurrences of its string (node 0: the root)
        self._kids: list[dict[int, int] | None] = [{}]  # node id -> next token -> ~node or tail
        self._free: list[int] = []  # ids of nodes gone, for reuse
        self.num_nodes = 0  # nodes held (the root not counted)
        self._tokens: dict[int, list[int]] = {}  # sequence id -> its tokens
        self._live: dict[int, _Live] = {}  # the sequences still growing

    # -- the sequences ------------------------------------------------------------------------
    def __contains__(self, seq: int) -> bool:
        return seq in self._tokens

    @property
    def num_tokens(self) -> int:
        """Tokens held, over every sequence."""
        return sum(len(t) for t in self._tokens.values())

    def tokens(self, seq: int) -> list[int]:
        """The tokens of a sequence (the trie's own list: do not change it)."""
        return self._tokens[seq]

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence `seq` (a new id starts one) and count their substrings."""
        if not isinstance(seq, int) or not 0 <= seq <= _LOW:
            raise ValueError(f"sequence ids are integers in [0, 2**32), got {seq!r}")
        if seq in self._tokens and seq not in self._live:
            raise ValueError(f"sequence {seq} was closed: it takes no more tokens")
        text = self._tokens.setdefault(seq, [])
        live = self._live.setdefault(seq, _Live())
        for token in tokens:
            self._append(seq, text, live, token)

    def close(self, seq: int) -> None:
        """No more tokens for `seq`: drop its loci (its counts stay until `remove`)."""
        self._live.pop(seq, None)

    def remove(self, seq: int) -> None:
        """Take sequence `seq` out: each of its occurrences leaves the counts (O(D) a token)."""
        text = self._tokens.pop(seq)
        self._live.pop(seq, None)
        depth, count, kids_of = self.max_depth, self._count, self._kids
        for start in range(len(text)):
            node, gone = 0, []
            for j in range(start, min(start + depth, len(text))):
                kids = kids_of[node]
                assert kids is not None
                kid = kids[text[j]]  # (this occurrence is counted on its path)
                if kid >= 0:  # its own tail: the rest of the path is this occurrence alone
                    if not gone:
                        del kids[text[j]]
                    break
                node = ~kid
                count[node] -= 1
                if not count[node]:
                    if not gone:  # (below a node gone, the edges go with it)
                        del kids[text[j]]
                    gone.append(node)
            for node in gone:
                kids_of[node] = None
                self._free.append(node)
            self.num_nodes -= len(gone)

    # -- one token --------------------------------------------------------------------------
    def _append(self, seq: int, text: list[int], live: _Live, token: int) -> None:
        """Count the strings that end at the new token: each active suffix's and the new one's."""
        n = len(text)
        text.append(token)
        depth, dormant, count, kids_of = self.max_depth, live.dormant, self._count, self._kids
        active, live.active = live.active, []
        active.append([n, 0, 0])
        for locus in active:
            start, node, at = locus
            length = n - start  # the suffix's string before `token`
            kids = kids_of[node]
            assert kids is not None
            while at < length:  # (woken: its path past `node` may run through nodes others made)
                kid = kids[text[start + at]]
                if kid >= 0:
                    break
                node, at = ~kid, at + 1
                kids = kids_of[node]
                assert kids is not None
            if at == length:
                kid = kids.get(token)
                if kid is None:
                    kids[token] = seq << _SHIFT | (n + 1)
                elif kid >= 0:
                    node = self._split(kid, length + 1)
                    kids[token] = ~node
                    at += 1
                else:
                    node = ~kid
                    count[node] += 1
                    at += 1
            if length + 1 < depth:
                locus[1], locus[2] = node, at
                if at > length:
                    live.active.append(locus)
                else:
                    dormant[start] = locus
        dormant.pop(n + 1 - depth, None)  # (its string reached D tokens)

    def _split(self, tail: int, depth: int) -> int:
        """The tail's string, at `depth`, seen a second time: a new node (its id) of count 2, the first
        occurrence's next token a tail below it; wakes the dormant suffix it was."""
        seq, end = tail >> _SHIFT, tail & _LOW
        text = self._tokens[seq]
        kids = {text[end]: tail + 1} if depth < self.max_depth and end < len(text) else {}
        if self._free:
            node = self._free.pop()
            self._count[node], self._kids[node] = 2, kids
        else:
            node = len(self._count)
            self._count.append(2)
            self._kids.append(kids)
        self.num_nodes += 1
        live = self._live.get(seq)
        if live is not None:
            woken = live.dormant.pop(end - depth, None)
            if woken is not None:
                live.active.append(woken)
        return node

    # -- reading ------------------------------------------------------------------------------
    def walk(self, context: Sequence[int]) -> Position | None:
        """Where the string `context` (at most D tokens) ends, or None if it never occurred."""
        pos = ROOT
        for token in context:
            if pos >= 0:
                text = self._tokens[pos >> _SHIFT]
                end = pos & _LOW
                if end >= len(text) or text[end] != token:
                    return None
                pos += 1
            else:
                kids = self._kids[~pos]
                assert kids is not None
                kid = kids.get(token)
                if kid is None:
                    return None
                pos = kid
        return pos

    def children(self, pos: Position, depth: int, limit: int) -> tuple[int, list[tuple[int, int, Position]]]:
        """(total, top): the occurrences of the string at `pos` (of length `depth`) that go on, and
        (token, count, position) of its `limit` most frequent next tokens (ties: the smaller id)."""
        if depth >= self.max_depth:
            return 0, []
        if pos >= 0:
            text = self._tokens[pos >> _SHIFT]
            end = pos & _LOW
            return (1, [(text[end], 1, pos + 1)]) if end < len(text) else (0, [])
        kids = self._kids[~pos]
        assert kids is not None
        count = self._count
        if len(kids) == 1:  # (the usual case deep down)
            ((token, kid),) = kids.items()
            n = 1 if kid >= 0 else count[~kid]
            return n, [(token, n, kid)]
        items = [(token, 1 if kid >= 0 else count[~kid], kid) for token, kid in kids.items()]
        top = heapq.nsmallest(limit, items, key=lambda item: (-item[1], item[0]))
        return sum(c for _, c, _ in items), top

    def has_next(self, pos: Position, depth: int) -> bool:
        """Whether some occurrence of the string at `pos` (of length `depth`) goes on."""
        if depth >= self.max_depth:
            return False
        if pos >= 0:
            return (pos & _LOW) < len(self._tokens[pos >> _SHIFT])
        return bool(self._kids[~pos])

    def longest_match(self, context: Sequence[int], max_len: int) -> tuple[int, Position] | None:
        """(m, position) of the longest suffix of `context`, m <= max_len tokens, that occurred with a
        next token; None when not even its last token did."""
        lo, hi = 0, min(max_len, len(context), self.max_depth - 1)
        best: tuple[int, Position] | None = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            pos = self.walk(context[len(context) - mid:])
            if pos is not None and self.has_next(pos, mid):
                lo, best = mid, (mid, pos)
            else:
                hi = mid - 1
        return best


class SuffixCache:
    """A `SuffixTrie` over earlier sequences holding at most `capacity` tokens (0: nothing), the
    oldest evicted; a sequence longer than the capacity keeps its last `capacity` tokens."""

    def __init__(self, max_depth: int, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0 (tokens), got {capacity!r}")
        self.trie = SuffixTrie(max_depth)
        self.capacity = capacity
        self.num_tokens = 0
        self._order: deque[int] = deque()  # sequence ids, oldest first
        self._next = 0

    def __len__(self) -> int:
        return len(self._order)

    def add(self, tokens: Sequence[int]) -> None:
        """Hold `tokens` as one more sequence, evicting the oldest to stay within capacity."""
        if not self.capacity or not tokens:
            return
        tokens = list(tokens[-self.capacity:])
        while self.num_tokens + len(tokens) > self.capacity:
            self._evict()
        seq = self._next
        self._next = (seq + 1) & _LOW
        self.trie.extend(seq, tokens)
        self.trie.close(seq)
        self._order.append(seq)
        self.num_tokens += len(tokens)

    def _evict(self) -> None:
        seq = self._order.popleft()
        self.num_tokens -= len(self.trie.tokens(seq))
        self.trie.remove(seq)

    def clear(self) -> None:
        """Forget every sequence."""
        while self._order:
            self._evict()
