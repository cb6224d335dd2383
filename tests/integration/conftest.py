"""Engine test fixtures: an LLM factory whose engines are leak-checked after every test.

`make_llm(model_dir, **engine_kwargs)` builds an `LLM`; when the test ends every engine it
built must report no leaks: every block free (or cached in the prefix tree at refcount 0),
every slot free, no request left in the scheduler, no draft slot left mapped.

The speculation end-to-end tests' setup (helpers/spec_e2e.py): `random_draft` (an
unrelated draft for checkpoint "a"), `prompts` (8 word prompts; a module may define its
own) and `plain_outputs` (their greedy tokens without speculation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.spec_e2e import plain_greedy, random_draft as make_random_draft, word_prompts
from infer import LLM


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    built: list[LLM] = []

    def factory(model_dir: str | Path, **kwargs: Any) -> LLM:
        kwargs.setdefault("device", "cpu")
        llm = LLM(str(model_dir), **kwargs)
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        assert llm.engine.leak_report() == [], llm.engine.leak_report()


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module")
def prompts(ckpt_a: Path) -> list[list[int]]:
    return word_prompts(ckpt_a)


@pytest.fixture(scope="module")
def plain_outputs(ckpt_a: Path, prompts: list[list[int]]) -> list[list[int]]:
    return plain_greedy(ckpt_a, prompts)
