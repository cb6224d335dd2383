"""SpecStats: engine-wide speculative decoding counters (exported by the server).

drafts: rounds that proposed a token; draft_tokens: tokens (tree nodes) proposed; accepted_tokens: of them accepted
(a tree: its path); emitted_tokens: tokens rounds produced (accepted + one each). Per position i (a chain's i-th draft,
a tree's depth i + 1), accepted_per_position[i] / drafted_per_position[i] count rounds; accepted_lengths[L]: rounds
accepting exactly L; shared_vocabulary: the fraction of the smaller vocabulary a foreign draft shares (None: one)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


def _minus(now: list[int], earlier: list[int]) -> list[int]:
    return [x - (earlier[i] if i < len(earlier) else 0) for i, x in enumerate(now)]


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    rounds: int = 0  # all verification rounds, including k = 0 ones
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    shared_vocabulary: float | None = None  # a draft with another vocabulary: the fraction it shares
    followed: int = 0  # steps whose round was queued before the host read the verdict before it

    def record(self, num_draft: int, num_accepted: int, num_emitted: int, depth: int | None = None) -> None:
        """One verification round: tokens proposed, accepted and emitted; `depth`: the deepest (default num_draft)."""
        depth = num_draft if depth is None else depth
        if not 0 <= num_accepted <= depth <= num_draft or (depth == 0) != (num_draft == 0):
            raise ValueError(f"num_accepted {num_accepted} outside 0..depth {depth}, or depth outside "
                             f"1..num_draft {num_draft} (0 without drafts)")
        self.rounds += 1
        self.emitted_tokens += num_emitted
        if num_draft == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        _grow(self.accepted_per_position, depth)
        _grow(self.drafted_per_position, depth)
        _grow(self.accepted_lengths, num_accepted + 1)
        for i in range(depth):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        self.accepted_lengths[num_accepted] += 1

    def minus(self, earlier: SpecStats) -> SpecStats:
        """The counts since `earlier` (a copy of these stats taken before)."""
        return SpecStats(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                         self.accepted_tokens - earlier.accepted_tokens, self.emitted_tokens - earlier.emitted_tokens,
                         self.rounds - earlier.rounds,
                         _minus(self.accepted_per_position, earlier.accepted_per_position),
                         _minus(self.drafted_per_position, earlier.drafted_per_position),
                         _minus(self.accepted_lengths, earlier.accepted_lengths), self.shared_vocabulary,
                         self.followed - earlier.followed)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per round that drafted (the paper's expected tokens per run)."""
        return self.emitted_tokens / self.rounds if self.rounds else None

    @property
    def mean_accepted_path(self) -> float | None:
        """Draft tokens accepted per drafting round (a tree: the accepted path's length)."""
        return self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Per position (a tree's depth - 1): accepted / proposed there."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]
