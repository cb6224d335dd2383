"""GPU fixtures: `ckpt_a` here is variant "a" with a head size the Triton kernels serve.

The flat forward's CUDA graphs need the split-KV attention kernel, which takes power-of-two
head sizes of at least 16 (`models.kernels.routes.kernels_serve`); the CPU suite's variant
"a" has head_dim 8, which runs every pass eagerly. The GPU tests that check graphs replay
get the same model with head_dim 16 (8 query heads over 2 KV heads, its rotary scaling kept).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def ckpt_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_a_gpu"), variant="a", head_dim=16)
