"""The shipped EAGLE-3 head of the demo target: it loads from the package, drafts losslessly
(greedy parity with plain decoding), and its drafts are accepted far more often than those
of the same head with random weights (the negative control, built in the test)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from demo_pair.completions import PROMPTS as COMPLETION_PROMPTS
from demo_pair.eagle_eval import run_config
from infer.engine.loading import DEMO_TARGET, demo_model_path

PROMPTS = COMPLETION_PROMPTS[:4]  # the demo pair's evaluation prompts
TOKENS = 32
EAGLE3 = dict(use_speculative_decoding=True, speculative_method="eagle3", spec_length=5, max_seq_len=128)


def random_head(shipped: Path, directory: Path) -> Path:
    """The shipped head's config and vocabulary maps, its weights redrawn (N(0, 0.02), norms 1)."""
    shutil.copytree(shipped, directory)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones_like(t) if name.endswith("norm.weight") else
                      (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)) if t.is_floating_point() else t
               for name, t in load_file(str(shipped / "model.safetensors")).items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def greedy_run(make_llm, **options) -> dict:
    return run_config(make_llm(DEMO_TARGET, **options), 0.0, TOKENS, PROMPTS)


def test_shipped_eagle3_head_drafts_losslessly_and_well(make_llm, tmp_path: Path) -> None:
    head = demo_model_path("eagle3")
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    plain = greedy_run(make_llm, max_seq_len=128)["tokens"]
    trained = greedy_run(make_llm, draft_model=str(head), **EAGLE3)
    control = greedy_run(make_llm, draft_model=str(random_head(head, tmp_path / "random")), **EAGLE3)
    assert trained["tokens"] == plain and control["tokens"] == plain  # lossless whatever the head drafts
    assert control["acceptance_rate"] < 0.02  # random drafts are almost never the target's argmax
    assert trained["acceptance_rate"] > 0.1 and trained["tokens_per_round"] > 1.4


def test_unknown_demo_role_is_refused() -> None:
    with pytest.raises(ValueError, match="eagle3"):
        demo_model_path("eagle")
