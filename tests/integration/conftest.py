"""Engine test fixtures (`make_llm` is the suite's, tests/conftest.py).

The speculation end-to-end tests' setup (helpers/spec_e2e.py): `random_draft` (an
unrelated draft for checkpoint "a"), `prompts` (8 word prompts; a module may define its
own), `plain_outputs` (their greedy tokens without speculation) and `heads` (an EAGLE and an
EAGLE-3 head of checkpoint "a").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.eagle_heads import write_head
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


@pytest.fixture(scope="module")
def heads(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {"eagle3": write_head(root / "eagle3", ckpt_a, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1]),
            "eagle": write_head(root / "eagle", ckpt_a, "eagle", fc_bias=True)}
