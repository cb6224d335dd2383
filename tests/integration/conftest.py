"""Engine test fixtures (`make_llm` is the suite's, tests/conftest.py).

The speculation end-to-end tests' setup (helpers/spec_e2e.py): `random_draft` (an
unrelated draft for checkpoint "a"), `prompts` (8 word prompts; a module may define its
own) and `plain_outputs` (their greedy tokens without speculation).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.spec_e2e import plain_greedy, random_draft as make_random_draft, word_prompts


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def prompts(ckpt_a: Path) -> list[list[int]]:
    return word_prompts(ckpt_a)


@pytest.fixture(scope="module")
def plain_outputs(ckpt_a: Path, prompts: list[list[int]]) -> list[list[int]]:
    return plain_greedy(ckpt_a, prompts)
