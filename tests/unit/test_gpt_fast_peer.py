"""The gpt-fast peer (bench/gpt_fast.py): what it asks of a checkout, and the shape it builds.

Timing it needs CUDA (a GPU run of `infer bench --suite decode-speed --gpt-fast PATH`); on the
CPU the checks before any model is built, and the import of a checkout, are tested on a
stand-in checkout written here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infer_bench import gpt_fast
from infer_bench.rows import GptFastCheckout, HarnessOptions
from infer.models.config import ModelConfig, RopeScaling

MODEL_PY = '''
from dataclasses import dataclass
@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5
    rope_scaling: dict = None
'''
GENERATE_PY = "from model import ModelArgs\nfrom tokenizer import get_tokenizer\nIMPORTED = True\n"


def _ctx(path: str | None) -> SimpleNamespace:
    return SimpleNamespace(options=HarnessOptions(gpt_fast=path), device=torch.device("cpu"))


def test_the_row_names_what_a_checkout_lacks(tmp_path: Path) -> None:
    assert "--gpt-fast PATH" in GptFastCheckout().missing(_ctx(None))
    (tmp_path / "model.py").write_text(MODEL_PY)
    assert GptFastCheckout().missing(_ctx(str(tmp_path))) == f"--gpt-fast {tmp_path} lacks generate.py"
    (tmp_path / "generate.py").write_text(GENERATE_PY)
    assert GptFastCheckout().missing(_ctx(str(tmp_path))) is None


def test_a_checkout_imports_with_a_stand_in_tokenizer_and_gets_our_shape(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="lacks model.py, generate.py"):
        gpt_fast._import_gpt_fast(tmp_path)
    (tmp_path / "model.py").write_text(MODEL_PY)
    (tmp_path / "generate.py").write_text(GENERATE_PY)
    for name in ("model", "generate", "tokenizer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    model, generate = gpt_fast._import_gpt_fast(tmp_path)  # no tokenizer.py: the stand-in serves
    assert generate.IMPORTED and model.__file__ == str(tmp_path / "model.py")
    config = ModelConfig(vocab_size=1000, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_theta=1e5, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192))
    args = gpt_fast.model_args(model, config, block_size=512)
    assert (args.vocab_size, args.dim, args.n_layer, args.n_head, args.n_local_heads, args.intermediate_size,
            args.block_size, args.rope_base, args.norm_eps) == (1000, 96, 3, 6, 2, 256, 512, 1e5, 1e-6)
    assert args.rope_scaling == dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)
    for name in ("model", "generate", "tokenizer"):
        sys.modules.pop(name, None)
