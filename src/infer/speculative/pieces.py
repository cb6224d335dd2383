"""Features kept as pieces: rows start:stop of a tensor, left unsliced until they are fed (an
EAGLE head's pending target features; a round's consecutive rows then stack as one view)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.transfer import tensor_on

Piece = tuple[torch.Tensor, int, int]  # rows start:stop of a features tensor [M, H], left unsliced


def stacked(pieces: Sequence[Piece]) -> torch.Tensor:
    """The pieces' rows end to end [sum of lengths, H] (at least one piece): a view when they are
    consecutive rows of one tensor, else one gather."""
    src = pieces[0][0]
    if all(t is src for t, _, _ in pieces):
        if all(pieces[i][2] == pieces[i + 1][1] for i in range(len(pieces) - 1)):
            return src[pieces[0][1]:pieces[-1][2]]
        return src.index_select(0, tensor_on([i for _, a, b in pieces for i in range(a, b)], src.device, torch.long))
    return torch.cat([t[a:b] for t, a, b in pieces])


def split_pieces(pieces: Sequence[Piece], cut: int) -> tuple[list[Piece], list[Piece]]:
    """The pieces' first `cut` rows and the rest, as pieces."""
    first: list[Piece] = []
    rest: list[Piece] = []
    for t, a, b in pieces:
        take = min(max(cut, 0), b - a)
        if take:
            first.append((t, a, a + take))
        if take < b - a:
            rest.append((t, a + take, b))
        cut -= take
    return first, rest
