"""N-gram speculative drafting: draft tokens from the request's own history, no draft model.

`NgramProposer` keeps one table per request, an `NgramTable` or a `PromptLookupTable`, over a
sliding window of its verified tokens only. docs/speculation.md, "N-gram tables and prompt lookup".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infer.sampling import is_strict_int
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.ngram_tables import METHODS, DraftTable, NgramConfig, NgramTable
from infer.speculative.prompt_lookup import PromptLookupTable
from infer.speculative.proposer import DraftRequest, HostProposer
from infer.speculative.tree import Draft, TreeShape, cut_depth

__all__ = ["METHODS", "NgramConfig", "NgramProposer", "NgramTable", "PromptLookupTable", "DraftTable"]

_TABLES: dict[str, type[NgramTable] | type[PromptLookupTable]] = {
    "ngram": NgramTable,
    "prompt_lookup": PromptLookupTable,
}
_TAIL = 16  # tokens compared to tell that a request's history was replaced


@dataclass(slots=True)
class _Entry:
    table: DraftTable
    synced: int  # number of the request's tokens the table has seen
    tail: list[int]  # the last (up to) _TAIL of those tokens


class NgramProposer(HostProposer):
    """Proposer over per-request n-gram (or prompt lookup) tables; drafts have probs=None."""

    building = "building its n-gram table"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config if config is not None else NgramConfig()
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def table(self, request_id: str) -> DraftTable | None:
        """The request's current table, or None if it has none (for inspection and tests)."""
        entry = self._entries.get(request_id)
        return entry.table if entry is not None else None

    def _new_table(self) -> DraftTable:
        cfg = self.config
        return _TABLES[cfg.method](cfg.max_order, cfg.min_order, cfg.window)

    def sync(self, request: DraftRequest) -> DraftTable:
        """Bring the request's table up to date: incremental, or rebuilt from the window when its
        history was replaced (its last `_TAIL` tokens differ) or the gap exceeds the window."""
        n = request.num_tokens
        entry = self._entries.get(request.request_id)
        if (entry is None or not entry.synced <= n < entry.synced + self.config.window
                or request.token_slice(entry.synced - len(entry.tail), entry.synced) != entry.tail):
            start = max(0, n - self.config.window)
            entry = self._entries[request.request_id] = _Entry(self._new_table(), start, [])
        if n > entry.synced:
            entry.table.extend(request.token_slice(entry.synced, n))
            entry.synced = n
            entry.tail = request.token_slice(max(0, n - _TAIL), n)
        return entry.table

    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        """One deterministic draft over `shape` per request (probs None), no deeper than depths[i]:
        a chain of the table's continuation, or a tree of its distinct continuations (`fill_tree`)."""
        if len(depths) != len(requests):
            raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
        drafts: list[Draft] = []
        empty = Draft.empty(shape)  # (frozen: shared by the rows that find nothing)
        for request, depth in zip(requests, depths, strict=True):
            if not is_strict_int(depth) or depth < 0:
                raise ValueError(f"depths must hold integers >= 0, got {depth!r} for request {request.request_id!r}")
            drafts.append(empty)
            if not depth:  # (its table catches up at its next lookup)
                continue
            with isolated(request, DRAFTING):
                table = self.sync(request)
                n = request.num_tokens
                context = request.token_slice(max(0, n - self.config.max_order + 1), n)
                if shape.is_chain:
                    drafts[-1] = Draft.chain(shape, table.propose(context, min(depth, shape.depth)))
                else:
                    drafts[-1] = cut_depth(table.propose_tree(context, shape), depth)
        return drafts

    def release(self, request: DraftRequest) -> None:
        """The request finished or was preempted: drop its table (a later propose rebuilds)."""
        self._entries.pop(request.request_id, None)

    def leak_report(self) -> list[str]:
        """Tables still held (of requests that never left)."""
        return [f"n-gram tables kept for {sorted(self._entries)}"] if self._entries else []
