"""Request bookkeeping helpers used on the hot path."""

from __future__ import annotations

import itertools

import pytest

from infer import SamplingParams
from infer.engine.request import Request


def test_token_slice_and_last_token_match_the_concatenated_history():
    r = Request("r", [5, 6, 7, 8], SamplingParams())
    assert r.last_token_id == 8
    r.output_token_ids += [9, 10, 11]
    full = r.all_token_ids
    assert r.last_token_id == 11
    for lo, hi in itertools.combinations(range(len(full) + 1), 2):
        assert r.token_slice(lo, hi) == full[lo:hi]
    assert r.token_slice(2) == full[2:]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        Request("r", [], SamplingParams())
