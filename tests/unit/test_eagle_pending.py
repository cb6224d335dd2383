"""An EAGLE head's pending features are kept as pieces of the tensors they came in
(`Piece`): a round's feed stacks them (a view when they are consecutive rows of one tensor,
as a round's are), a catch-up splits them at a row count."""

from __future__ import annotations

import torch

from infer.speculative.eagle import split_pieces, stacked


def test_consecutive_pieces_of_one_tensor_stack_as_a_view() -> None:
    src = torch.arange(12.0).view(6, 2)
    out = stacked([(src, 1, 3), (src, 3, 4), (src, 4, 6)])
    assert out.data_ptr() == src[1].data_ptr() and out.tolist() == src[1:6].tolist()


def test_pieces_out_of_order_or_of_several_tensors_stack_in_order() -> None:
    a, b = torch.arange(12.0).view(6, 2), -torch.arange(6.0).view(3, 2)
    assert stacked([(a, 4, 6), (a, 0, 1)]).tolist() == [*a[4:6].tolist(), *a[0:1].tolist()]
    assert stacked([(a, 0, 2), (b, 1, 3)]).tolist() == [*a[0:2].tolist(), *b[1:3].tolist()]


def test_split_pieces_cuts_at_a_row_count() -> None:
    a, b = torch.zeros(5, 1), torch.zeros(4, 1)
    pieces = [(a, 1, 4), (b, 0, 2)]  # 3 + 2 rows
    for cut, first, rest in ((0, [], pieces), (2, [(a, 1, 3)], [(a, 3, 4), (b, 0, 2)]),
                             (3, [(a, 1, 4)], [(b, 0, 2)]), (4, [(a, 1, 4), (b, 0, 1)], [(b, 1, 2)]),
                             (5, pieces, [])):
        got = split_pieces(pieces, cut)
        assert [(t is a, i, j) for t, i, j in got[0]] == [(t is a, i, j) for t, i, j in first]
        assert [(t is a, i, j) for t, i, j in got[1]] == [(t is a, i, j) for t, i, j in rest]
