"""`SamplingParams.speculation` validated on construction, and the engine's limit on it
(`check_request_speculation`)."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.engine.speculation import check_request_speculation


@pytest.mark.parametrize("value, drafts", [(None, None), (False, 0), (1, 1), (7, 7)])
def test_speculation_values_and_the_drafts_they_allow(value: bool | int | None, drafts: int | None) -> None:
    assert SamplingParams(speculation=value).max_drafts == drafts


@pytest.mark.parametrize("value", [True, 0, -2, 1.0, 2.5, "3"])
def test_other_values_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^speculation must be None .* False .* integer K >= 1"):
        SamplingParams(speculation=value)  # type: ignore[arg-type]


def test_the_engines_limit() -> None:
    for value in (None, False, 1, 4):
        check_request_speculation(value, 4)
    with pytest.raises(ValueError, match=r"^speculation 5 is more than this engine drafts \(spec_length 4\)"):
        check_request_speculation(5, 4)
    check_request_speculation(False, None)  # (plain decoding on an engine without speculation)
    check_request_speculation(None, None)
    with pytest.raises(ValueError, match="does not run"):
        check_request_speculation(1, None)
