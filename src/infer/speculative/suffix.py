"""Suffix decoding: tree-shaped drafts from suffix tries, no draft model (SuffixDecoding,
Oliaro et al. 2024, arXiv 2411.04975). `SuffixProposer` drafts from the request's own trie and
the shared `SuffixCache` of finished outputs, one-hot. docs/speculation.md, "Suffix decoding".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.sampling import is_strict_int
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.node_tree import DynamicShape, NodeTree
from infer.speculative.proposer import DraftRequest, HostProposer
from infer.speculative.suffix_draft import SuffixTree, grow_tree
from infer.speculative.suffix_trie import SuffixCache, SuffixTrie
from infer.speculative.tree import Draft, TreeShape, chain_shape

_TAIL = 16  # tokens compared to tell that a request's history was replaced
_OWN = 0  # the sequence id of a request's own tokens in its trie


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    """The tries' depth, the shared cache's size and the drafts' probability floor."""

    max_depth: int = 48  # D: substrings up to D tokens are counted; a match of m leaves D - m to draft
    cache_tokens: int = 65536  # the shared cache of earlier outputs, in tokens (0: none)
    min_prob: float = 0.1  # a draft node's estimated probability (along its path) must reach this

    def __post_init__(self) -> None:
        if not is_strict_int(self.max_depth) or self.max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2 (a match of one token and one to draft), "
                             f"got {self.max_depth!r}")
        if not is_strict_int(self.cache_tokens) or self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be an integer >= 0 (0: no cache of earlier outputs), "
                             f"got {self.cache_tokens!r}")
        if isinstance(self.min_prob, bool) or not isinstance(self.min_prob, (int, float)) \
                or not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must be a number in [0, 1], got {self.min_prob!r}")


@dataclass(slots=True)
class _Entry:
    trie: SuffixTrie
    synced: int  # number of the request's tokens the trie holds
    tail: list[int]  # the last (up to) _TAIL of them


class SuffixProposer(HostProposer):
    """Proposer drafting suffix-trie trees; drafts have probs=None."""

    building = "building its suffix trie"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config if config is not None else SuffixConfig()
        self.cache = SuffixCache(self.config.max_depth, self.config.cache_tokens)
        self._entries: dict[str, _Entry] = {}

    def trie(self, request_id: str) -> SuffixTrie | None:
        """The request's own trie, or None (for inspection and tests)."""
        entry = self._entries.get(request_id)
        return entry.trie if entry is not None else None

    def sync(self, request: DraftRequest) -> SuffixTrie:
        """The request's trie with every known token: extended, or rebuilt when its history was replaced."""
        n = request.num_tokens - request.pending_tokens
        entry = self._entries.get(request.request_id)
        if (entry is None or n < entry.synced
                or request.token_slice(entry.synced - len(entry.tail), entry.synced) != entry.tail):
            entry = self._entries[request.request_id] = _Entry(SuffixTrie(self.config.max_depth), 0, [])
        if n > entry.synced:
            entry.trie.extend(_OWN, request.token_slice(entry.synced, n))
            entry.synced = n
            entry.tail = request.token_slice(max(0, n - _TAIL), n)
        return entry.trie

    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape | DynamicShape,
                depths: Sequence[int]) -> list[Draft]:
        """One deterministic draft per request, no deeper than depths[i] (0: none): a tree over the
        round's `DynamicShape`, or chains when every row's is a path."""
        if not isinstance(shape, DynamicShape):
            raise ValueError(f"suffix drafts are dynamic trees: the round's shape must be a DynamicShape, got {shape}")
        if len(depths) != len(requests):
            raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
        trees: list[SuffixTree | None] = []
        for request, depth in zip(requests, depths, strict=True):
            if not is_strict_int(depth) or depth < 0:
                raise ValueError(f"depths must hold integers >= 0, got {depth!r} for request {request.request_id!r}")
            trees.append(None)
            if depth:
                with isolated(request, DRAFTING):
                    trees[-1] = self._best_tree(request, min(depth, shape.depth), shape)
        return _drafts(trees, shape)

    def _best_tree(self, request: DraftRequest, k: int, shape: DynamicShape) -> SuffixTree | None:
        """The higher-scoring of the request's own trie's tree and the cache's (None: no match)."""
        own = self.sync(request)
        room = self.config.max_depth - k  # the longest match that leaves k tokens to draft
        if room < 1:
            return None
        n = request.num_tokens - request.pending_tokens
        context = request.token_slice(max(0, n - room), n)
        best: SuffixTree | None = None
        for trie in (own, self.cache.trie) if len(self.cache) else (own,):
            match = trie.longest_match(context, room)
            if match is None:
                continue
            m, pos = match
            tree = grow_tree(trie, pos, m, k, min(shape.nodes, m), shape.branch, self.config.min_prob)
            if tree.tokens and (best is None or tree.score > best.score):
                best = tree
            if best is not None and best.score >= min(shape.nodes, room):
                break  # (no tree scores more: one node a matched token at most, each at most 1)
        return best

    def release(self, request: DraftRequest) -> None:
        """Drop the request's trie; a finished one's output (from its prompt's last D - 1 tokens) joins the cache."""
        self._entries.pop(request.request_id, None)
        if request.is_finished and self.config.cache_tokens:
            prompt = len(request.prompt_token_ids)
            known = request.num_tokens - request.pending_tokens
            if known > prompt:
                self.cache.add(request.token_slice(max(0, prompt - self.config.max_depth + 1), known))

    def reset_history(self) -> None:
        """Forget the cache of earlier requests' outputs (the requests running keep their tries)."""
        self.cache.clear()

    def leak_report(self) -> list[str]:
        """Tries still held (of requests that never left); the cache is held on purpose."""
        return [f"suffix tries kept for {sorted(self._entries)}"] if self._entries else []


def _drafts(trees: Sequence[SuffixTree | None], shape: DynamicShape) -> list[Draft]:
    """The round's drafts: chains when every tree found is a path, else `NodeTree`s."""
    found = [t for t in trees if t is not None]
    if found and all(t.is_path for t in found):
        chain = chain_shape(max(len(t.tokens) for t in found))
        return [Draft.chain(chain, t.tokens if t is not None else ()) for t in trees]
    empty = Draft.empty(NodeTree((), shape.widths))  # type: ignore[arg-type]
    return [empty if t is None else Draft(NodeTree(t.parents, shape.widths), t.tokens, (True,) * len(t.tokens))
            for t in trees]
