"""bf16 parity with transformers on CUDA (run on the GPU machine: pytest -m gpu tests/gpu).

bf16 cannot be compared bit for bit: two correct implementations round differently. So
each check is relative to an fp32 reference (transformers in fp32 on the same GPU):
  * logits: our bf16 error against fp32 must be no worse than transformers' own bf16 error
    (within a factor), and top-1 agreement with fp32 must be high;
  * greedy generation: our bf16 tokens must equal transformers' bf16 tokens until the
    first divergence, and any divergence must happen where the fp32 reference sees the
    two chosen tokens as a near-tie (a rounding decision, not a bug): their fp32 logit gap
    must be within twice the largest bf16 rounding error (ours or transformers', against
    fp32) on that same row. With these peaked random models the bf16 logit error is about
    0.03 on average, so divergence after some tokens is expected and not a failure.
The real-shape test builds Llama-3.2-1B with dummy weights, saves it with save_checkpoint
and compares against transformers loading that directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import encode, hf_greedy, load_hf_model, nocache_greedy
from infer.models.loading.checkpoint import save_checkpoint
from infer.models.loading.loader import load_model

pytestmark = pytest.mark.gpu

CUDA = "cuda"
PROMPTS = ["The quick brown fox", "Once upon a time there was a little robot who loved",
           "def forward(self, input_ids):", "User: What is the capital of France? Assistant:"]
NEW_TOKENS = 32
ERROR_FACTOR = 1.5  # our bf16 error may exceed transformers' bf16 error by this factor


def _hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device)).logits.float()


def _our_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(CUDA)).float()


def _compare(ours: torch.Tensor, hf_bf16: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    return {
        "ours_err": (ours - ref).abs().mean().item(),
        "hf_err": (hf_bf16 - ref).abs().mean().item(),
        "top1_ref": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "top1_hf": (ours.argmax(-1) == hf_bf16.argmax(-1)).float().mean().item(),
    }


@pytest.fixture(scope="module", params=["a", "b", "c"])
def models(request: pytest.FixtureRequest) -> dict[str, Any]:
    directory: Path = request.getfixturevalue(f"ckpt_{request.param}")
    ours, _ = load_model(str(directory), dtype="bf16", device=CUDA)
    return {"dir": directory, "ours": ours,
            "hf_bf16": load_hf_model(directory, torch.bfloat16, CUDA),
            "hf_fp32": load_hf_model(directory, torch.float32, CUDA)}


def test_loads_onto_cuda_in_bf16(models: dict[str, Any]) -> None:
    ours = models["ours"]
    assert {p.device.type for p in ours.parameters()} == {"cuda"}
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.rotary.inv_freq.dtype == torch.float32


def test_bf16_logits_close_to_transformers(models: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, models["ours"].config.vocab_size, (4, 64), generator=gen)  # [B, T]
    stats = _compare(_our_logits(models["ours"], ids), _hf_logits(models["hf_bf16"], ids),
                     _hf_logits(models["hf_fp32"], ids))
    print("bf16 logits vs fp32:", stats)
    assert stats["ours_err"] <= ERROR_FACTOR * stats["hf_err"] + 1e-3, stats
    assert stats["top1_ref"] >= 0.95 and stats["top1_hf"] >= 0.95, stats


def test_bf16_greedy_matches_transformers_up_to_near_ties(models: dict[str, Any]) -> None:
    ours, hf_bf16, hf_fp32 = models["ours"], models["hf_bf16"], models["hf_fp32"]
    prompts = [encode(models["dir"], text) for text in PROMPTS]
    eos = set(ours.config.eos_token_ids)
    batched = nocache_greedy(ours, prompts, NEW_TOKENS, eos)
    for prompt, got in zip(prompts, batched, strict=True):
        expected = hf_greedy(hf_bf16, prompt, NEW_TOKENS)
        i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if i is None:
            assert len(got) == len(expected)
            print("greedy: all", len(got), "tokens match")
            continue
        prefix = torch.tensor([prompt + got[:i]])
        ref = _hf_logits(hf_fp32, prefix)[0, -1]  # [V]
        rounding = max((_our_logits(ours, prefix)[0, -1] - ref).abs().max().item(),
                       (_hf_logits(hf_bf16, prefix)[0, -1] - ref).abs().max().item())
        gap = (ref[got[i]] - ref[expected[i]]).abs().item()
        print(f"greedy: diverged at new token {i}, fp32 gap {gap:.4f}, bf16 rounding {rounding:.4f}")
        assert gap <= 2 * rounding, f"diverged at new token {i} where fp32 sees a clear winner"


def test_real_shape_1b_dummy_matches_transformers(tmp_path: Path) -> None:
    """Llama-3.2-1B shapes (GQA 32:8, head_dim 64, llama3 RoPE factor 32, tied) end to end."""
    ours, config = load_model("dummy:llama-3.2-1b", dtype="bf16", device=CUDA)
    directory = save_checkpoint(ours, tmp_path / "llama-3.2-1b-dummy", max_shard_bytes=1 << 30)
    assert len(list(directory.glob("model-*-of-*.safetensors"))) >= 2
    reloaded, _ = load_model(str(directory), dtype="bf16", device=CUDA)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 256), generator=gen)  # [B, T]
    ours_logits = _our_logits(ours, ids)
    assert torch.equal(_our_logits(reloaded, ids), ours_logits)
    del reloaded
    hf_bf16 = load_hf_model(directory, torch.bfloat16, CUDA)
    hf_logits = _hf_logits(hf_bf16, ids)
    del hf_bf16
    ref = _hf_logits(load_hf_model(directory, torch.float32, CUDA), ids)
    stats = _compare(ours_logits, hf_logits, ref)
    print("llama-3.2-1b dummy bf16 vs fp32:", stats)
    assert stats["ours_err"] <= ERROR_FACTOR * stats["hf_err"] + 1e-4, stats
