"""A request's next round drafted ahead under the current round's verification (`AheadRound`,
extended by each proposer: the draft model's `DraftAhead`, the EAGLE head's `AheadMark`), and
the one rule by which the next `propose` takes it (`takes`) or drops it (`AheadRound.drop`).
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
    """A request's next round, drafted ahead (`Proposer.verifying`): the round's tokens,
    shared by the rows drafted together, and this request's row of them."""

    tokens: RoundTokens  # [B, steps] the round's drafts, on the device
    row: int  # this request's row of the round
    steps: int
    start: int  # the request's computed tokens when the round it follows began
    accepted: int | None = field(default=None, init=False)  # that round's accepted drafts, once verified

    @property
    def next_start(self) -> int | None:
        """The computed tokens the round drafted ahead starts from (None: the round it follows
        is not verified yet)."""
        return None if self.accepted is None else self.start + self.accepted + 1

    def follows_in_flight(self, k: int, computed: int) -> bool:
        """Whether a chain of k, `computed` tokens in, is this round while the round it follows
        is in flight (its verdict unread: the host counts all its drafts accepted)."""
        return self.accepted is None and k == self.steps and computed == self.start + k + 1

    def kept(self) -> int:
        """The cache positions a drop leaves: those before `start` (`DraftAhead` keeps more)."""
        return self.start

    def drop(self, pool: CachePoolProtocol, slot: int) -> None:
        """Forget what the round ahead wrote from `kept()` on; the slot keeps its blocks. The
        scheduler grew every proposer's cache for this step before `propose`
        (`KVManager.ensure_capacity`): a round drafted in its place writes into them (freed,
        it would have to take them again); a row drafting nothing holds them until its next
        round's `on_accepted` cuts its cache, or its release."""
        pool.set_length(slot, min(self.kept(), pool.seq_len(slot)))


def takes(mark: AheadRound, shape: TreeShape | DynamicShape, k: int, computed: int,
          in_flight: bool = False) -> bool:
    """Whether a request's round of depth k, `computed` tokens in, is the one drafted ahead in
    `mark`: a chain of 0 < k <= its steps right after the round it follows, that round
    verified; or, with `in_flight` (a proposer following rounds whose verdict is unread:
    `Proposer.can_follow`), a chain of its steps after that round counted all accepted."""
    if not (isinstance(shape, TreeShape) and shape.is_chain):
        return False
    if mark.next_start is None:
        return in_flight and mark.follows_in_flight(k, computed)
    return 0 < k <= min(mark.steps, shape.depth) and computed == mark.next_start
