"""A request's next round drafted ahead under the current round's verification (`AheadRound`), and
the rule by which the next `propose` takes it (`takes`) or drops it (`AheadRound.drop`).
docs/speculation.md, "A draft model" and "An EAGLE head".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.speculative.tree import RoundTokens, TreeShape

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.speculative.node_tree import DynamicShape


@dataclass
class AheadRound:
    """A request's next round, drafted ahead (`Proposer.verifying`): the round's tokens and its row."""

    tokens: RoundTokens  # [B, steps] the round's drafts, on the device
    row: int  # this request's row of the round
    steps: int
    start: int  # the request's computed tokens when the round it follows began
    accepted: int | None = field(default=None, init=False)  # that round's accepted drafts, once verified

    @property
    def next_start(self) -> int | None:
        """The computed tokens the round ahead starts from (None: the round it follows is unverified)."""
        return None if self.accepted is None else self.start + self.accepted + 1

    def follows_in_flight(self, k: int, computed: int) -> bool:
        """Whether a chain of k, `computed` tokens in, is this round while the round it follows
        is in flight (its verdict unread: the host counts all its drafts accepted)."""
        return self.accepted is None and k == self.steps and computed == self.start + k + 1

    def kept(self) -> int:
        """The cache positions a drop leaves: those before `start` (`DraftAhead` keeps more)."""
        return self.start

    def drop(self, pool: CachePoolProtocol, slot: int) -> None:
        """Forget what the round ahead wrote from `kept()` on; the slot keeps its blocks (the
        scheduler grew them for this step's round)."""
        pool.set_length(slot, min(self.kept(), pool.seq_len(slot)))


def takes(mark: AheadRound, shape: TreeShape | DynamicShape, k: int, computed: int,
          in_flight: bool = False) -> bool:
    """Whether a request's round of depth k, `computed` tokens in, is the one drafted ahead in `mark`:
    a chain of 0 < k <= its steps right after the verified round it follows, or with `in_flight`
    (`Proposer.can_follow`) a chain of its steps after that round counted all accepted."""
    if not (isinstance(shape, TreeShape) and shape.is_chain):
        return False
    if mark.next_start is None:
        return in_flight and mark.follows_in_flight(k, computed)
    return 0 < k <= min(mark.steps, shape.depth) and computed == mark.next_start
