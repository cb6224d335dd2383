"""SpecStats for tree rounds: nodes proposed, the accepted path's length, acceptance by depth,
rounds by accepted length, and the differences the benchmark takes."""

from __future__ import annotations

import pytest

from infer.speculative.metrics import SpecStats


def test_tree_rounds_count_nodes_paths_and_depths():
    s = SpecStats()
    s.record(21, 4, 5, depth=4)  # a tree "3,2,1,1": 21 nodes, the full path accepted
    s.record(21, 1, 2, depth=4)
    s.record(9, 0, 1, depth=2)  # cut at depth 2 by a length guard
    s.record(0, 0, 1)  # a row that did not draft
    assert (s.rounds, s.drafts, s.draft_tokens, s.accepted_tokens, s.emitted_tokens) == (4, 3, 51, 5, 9)
    assert s.drafted_per_position == [3, 3, 2, 2]
    assert s.accepted_per_position == [2, 1, 1, 1]
    assert s.accepted_lengths == [1, 1, 0, 0, 1]
    assert s.acceptance_by_depth == [2 / 3, 1 / 3, 0.5, 0.5]
    assert s.mean_accepted_path == 5 / 3 and s.mean_accepted_length == 9 / 4


def test_chain_rounds_keep_their_meaning():
    s = SpecStats()
    s.record(4, 2, 3)
    assert (s.drafted_per_position, s.accepted_per_position, s.accepted_lengths) == ([1] * 4, [1, 1, 0, 0],
                                                                                   [0, 0, 1])


@pytest.mark.parametrize("args", [(4, 3, 4, 2), (4, 1, 2, 5), (0, 0, 1, 1), (3, 0, 1, 0)])
def test_inconsistent_rounds_are_refused(args):
    with pytest.raises(ValueError, match="num_accepted"):
        SpecStats().record(*args)


def test_minus_covers_the_per_depth_counters():
    s = SpecStats()
    s.record(21, 2, 3, depth=4)
    before = SpecStats(**{k: list(v) if isinstance(v, list) else v for k, v in s.__dict__.items()})
    s.record(9, 2, 3, depth=2)
    d = s.minus(before)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (1, 9, 2)
    assert (d.drafted_per_position, d.accepted_per_position, d.accepted_lengths) == ([1, 1, 0, 0], [1, 1, 0, 0],
                                                                                   [0, 0, 1])
