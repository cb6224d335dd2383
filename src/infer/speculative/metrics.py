"""SpecStats: engine-wide speculative decoding counters (exported by the server).

drafts: speculation rounds that proposed at least one token; draft_tokens: tokens proposed;
accepted_tokens: proposed tokens accepted; accepted_per_position[i]: rounds whose (i+1)-th
proposed token was accepted; emitted_tokens: tokens produced by speculative rounds
(accepted + one recovered or bonus token each).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    rounds: int = 0  # all verification rounds, including k = 0 ones
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"num_accepted {num_accepted} outside 0..{num_draft}")
        self.rounds += 1
        self.emitted_tokens += num_emitted
        if num_draft == 0:
            return
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def minus(self, earlier: SpecStats) -> SpecStats:
        """The counts since `earlier` (a copy of these stats taken before)."""
        per_position = [n - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position) else 0)
                        for i, n in enumerate(self.accepted_per_position)]
        return SpecStats(self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                         self.accepted_tokens - earlier.accepted_tokens, self.emitted_tokens - earlier.emitted_tokens,
                         self.rounds - earlier.rounds, per_position)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per round that drafted (the paper's expected tokens per run)."""
        return self.emitted_tokens / self.rounds if self.rounds else None
