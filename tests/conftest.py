"""Session fixtures shared by the whole suite: tiny Hugging Face checkpoints, GPU skipping.

`ckpt_a`, `ckpt_b`, `ckpt_c` are complete model directories (weights, config, tokenizer)
written once per session by `helpers.checkpoints.make_checkpoint` (see its docstring for
what each variant exercises); `tiny_model_dir` is `ckpt_a`. `make_llm(model_dir,
**engine_kwargs)` builds an `LLM` (on the CPU unless `device` is given); when the test ends
every engine it built must report no leaks: every block free (or cached in the prefix tree
at refcount 0), every slot free, no request left in the scheduler, no draft slot left
mapped. `tp_ckpt` (8 query heads over 4 KV heads: both split in two) and `tp_draft` (its
unrelated one-layer draft) serve the tensor-parallel tests. Tests marked `gpu` are
skipped when CUDA is unavailable (they are deselected by default; the GPU machine runs
`pytest -m gpu tests/gpu`).

CPU tests run torch single-threaded (override with INFER_TEST_THREADS): the test models
are tiny, and with several test processes sharing few cores, intra-op threads spin against
each other and make many-small-forward tests (greedy loops) 10-30x slower.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import make_checkpoint
from infer import LLM


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(int(os.environ.get("INFER_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_a"), variant="a")


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_b"), variant="b")


@pytest.fixture(scope="session")
def ckpt_c(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_c"), variant="c")


@pytest.fixture(scope="session")
def tiny_model_dir(ckpt_a: Path) -> Path:
    return ckpt_a


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu tests/gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp_ckpt"), variant="a", num_key_value_heads=4)


@pytest.fixture(scope="session")
def tp_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # same tokenizer and vocabulary, unrelated weights, one layer
    return make_checkpoint(tmp_path_factory.mktemp("tp_draft"), variant="a", seed=123, num_hidden_layers=1,
                           num_key_value_heads=4)


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
