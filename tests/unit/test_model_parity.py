"""Our Llama forward pass against transformers' LlamaForCausalLM (fp32, CPU).

Logits must agree within 1e-4 on every checkpoint variant (llama3 RoPE scaling + tied
embeddings + 4:1 GQA; untied without scaling; head_dim != hidden / heads), for plain
prompts, right-padded batches and positions past RoPE scaling's original context.
Greedy generation must be token-identical to `transformers.generate`, for each prompt
alone and for all prompts in one right-padded batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.checkpoints import encode, hf_greedy, load_hf_model, nocache_greedy
from infer.models.layers.attention import NoCacheView
from infer.models.loading.loader import load_model

ATOL = 1e-4
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little robot who loved",
    "def forward(self, input_ids):",
    "User: What is the capital of France? Assistant:",
    "42",
    "said hello to the librarian and picked a new story about the mountains and the sea",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["a", "b", "c"])
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any, Path]:
    """(HF reference model, our model, checkpoint directory) for one variant."""
    directory: Path = request.getfixturevalue(f"ckpt_{request.param}")
    ours, _ = load_model(str(directory), dtype=torch.float32)
    return load_hf_model(directory), ours, directory


def _random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)  # [B, T]


def test_logits_match_transformers(pair: tuple[Any, Any, Path]) -> None:
    hf, ours, _ = pair
    ids = _random_ids(ours.config.vocab_size, batch=3, length=40)
    with torch.no_grad():
        expected = hf(ids).logits  # [B, T, V]
        got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= ATOL


def test_logits_match_with_explicit_positions(pair: tuple[Any, Any, Path]) -> None:
    """Gapped / strided positions reaching past original_max_position_embeddings (64 in
    variant a), so relative distances differ from 0..T-1 and RoPE scaling matters."""
    hf, ours, _ = pair
    ids = _random_ids(ours.config.vocab_size, batch=2, length=16, seed=1)
    gapped = torch.cat([torch.arange(8), 250 + torch.arange(8)])
    positions = torch.stack([gapped, 20 * torch.arange(16)])  # [B, T]
    with torch.no_grad():
        expected = hf(ids, position_ids=positions).logits
        got = ours(ids, positions)
        contiguous = ours(ids)  # same tokens at positions 0..15
    assert (got - expected).abs().max().item() <= ATOL
    assert (got - contiguous).abs().max().item() > 1e-3  # positions really were applied


def test_right_padded_batch_matches_rows_alone(pair: tuple[Any, Any, Path]) -> None:
    hf, ours, _ = pair
    lens = [5, 23, 12]
    ids = _random_ids(ours.config.vocab_size, batch=3, length=max(lens), seed=2)
    with torch.no_grad():
        got = ours(ids, view=NoCacheView(torch.tensor(lens)))  # [B, T, V]
        for row, n in enumerate(lens):
            expected = hf(ids[row:row + 1, :n]).logits[0]  # [n, V]
            assert (got[row, :n] - expected).abs().max().item() <= ATOL


def test_logits_indices_select_rows(pair: tuple[Any, Any, Path]) -> None:
    _, ours, _ = pair
    ids = _random_ids(ours.config.vocab_size, batch=2, length=10, seed=3)
    idx = torch.tensor([3, 9])
    with torch.no_grad():
        full = ours(ids)  # [B, T, V]
        picked = ours(ids, logits_indices=idx)  # [B, V]
    assert picked.shape == (2, ours.config.vocab_size)
    assert torch.allclose(picked, full[torch.arange(2), idx], atol=1e-5)


def test_greedy_generation_matches_transformers(pair: tuple[Any, Any, Path]) -> None:
    hf, ours, directory = pair
    prompts = [encode(directory, text) for text in PROMPTS]
    assert len({len(p) for p in prompts}) >= 4  # lengths differ, so the batch is really padded
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    eos = set(ours.config.eos_token_ids)
    alone = [nocache_greedy(ours, [p], NEW_TOKENS, eos)[0] for p in prompts]
    batched = nocache_greedy(ours, prompts, NEW_TOKENS, eos)
    for row, ref in enumerate(expected):
        assert len(ref) == NEW_TOKENS or ref[-1] in eos
        assert alone[row] == ref, f"prompt {row} alone diverges from transformers"
        assert batched[row] == ref, f"prompt {row} in the padded batch diverges from transformers"


def test_variants_differ_in_what_they_claim(ckpt_a: Path, ckpt_b: Path, ckpt_c: Path) -> None:
    """The fixtures exercise what the parity tests rely on them for."""
    a, _ = load_model(str(ckpt_a))
    b, _ = load_model(str(ckpt_b))
    c, _ = load_model(str(ckpt_c))
    assert a.config.rope_scaling is not None and a.config.tie_word_embeddings
    assert a.config.num_attention_heads == 4 * a.config.num_key_value_heads > 4
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert b.config.rope_scaling is None and not b.config.tie_word_embeddings
    assert not torch.equal(b.lm_head.weight, b.model.embed_tokens.weight)
    assert c.config.head_dim * c.config.num_attention_heads != c.config.hidden_size
