"""An EAGLE head's per-request state (`HeadState`), its round drafted ahead (`AheadMark`) and the
device moves of rows following a round in flight (`moves`). docs/speculation.md, "An EAGLE head"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infer.speculative.ahead import AheadRound
from infer.speculative.pieces import Piece
from infer.transfer import tensor_on


@dataclass
class AheadMark(AheadRound):
    """The EAGLE head's round drafted ahead (`EagleProposer.verifying`), fed from `start`, the
    positions its head cache held before (all a drop keeps)."""

    features: torch.Tensor  # [B (steps + 1), H] the features it fed, each row's block
    counts: torch.Tensor  # [B] the accepted drafts of the round it follows, on the device


@dataclass
class HeadState:
    """One request's head cache: slot position p holds the head's entry of target position p."""

    slot: int | None = None  # taken at admission after a prefix hit, at the first feed otherwise
    pending: list[Piece] = field(default_factory=list)  # features of the positions after the cache
    round_end: int | None = None  # slot positions holding target features during a round (drafts past it)
    ahead: AheadMark | None = None  # the next round drafted ahead; the cache then counts as `start`
    # the round in flight it follows (`can_follow`): counts [B], its row, k (positions move by counts[row] - k)
    follows: tuple[torch.Tensor, int, int] | None = None
    prompt_offered: bool = False  # every full prompt block offered to the prefix cache (`_share`)

    def num_pending(self) -> int:
        return sum(b - a for _, a, b in self.pending)


def moves(states: Sequence[HeadState]) -> torch.Tensor | None:
    """[B] each row's move on the device where the rows follow a round in flight, else None."""
    follows = [s.follows for s in states]
    if follows[0] is None:
        return None
    counts, _, k = follows[0]
    if any(f is None or f[0] is not counts or f[2] != k for f in follows):
        raise RuntimeError("rows of a round drafted ahead follow different rounds in flight")
    rows = [f[1] for f in follows]  # type: ignore[index]
    picked = counts[:len(rows)] if rows == list(range(len(rows))) else counts[tensor_on(rows, counts.device, torch.long)]
    return picked - k
