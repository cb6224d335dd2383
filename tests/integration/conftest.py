"""Engine test fixtures: an LLM factory whose engines are leak-checked after every test.

`make_llm(model_dir, **engine_kwargs)` builds an `LLM`; when the test ends every engine it
built must report no leaks: every block free (or cached in the prefix tree at refcount 0),
every slot free, no request left in the scheduler, no draft slot left mapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

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
