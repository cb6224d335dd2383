"""The Qwen2 / Qwen2.5, Qwen3 and Mistral families: tiny random-weight models made by
transformers' own classes (helpers.checkpoints.make_family_checkpoint) give transformers'
logits and greedy tokens, in Hugging Face layout and written to GGUF (F32, F16, Q8_0 and
K-quants; the reference for a GGUF file is transformers' own GGUF loader), with FP8 weights,
and a sliding window longer than the context is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers.checkpoints import hf_greedy, load_hf_model, make_family_checkpoint, nocache_greedy
from helpers.gguf_files import write_gguf
from infer import LLM, SamplingParams
from infer.models.loading.gguf.reader import GGUFFile
from infer.models.loading.loader import load_model

FAMILIES = ["qwen2", "qwen3", "mistral"]
IDS = torch.tensor([[5, 77, 123, 9, 300, 41, 2, 250, 18, 64, 99, 7]])  # [1, T]
PROMPTS = [[3, 17, 250, 41, 9], [100, 7, 7, 300, 12, 64, 2, 18, 5]]
K_MIX = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_K,
         "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q5_K}


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return out if isinstance(out, torch.Tensor) else out.logits  # ours, or transformers'


def _transformers_gguf(path: Path, ckpt: Path, family: str) -> Any:
    """transformers' own GGUF loader. It does not read `key_length` (Qwen3's head_dim 32 !=
    hidden / heads), so for the Qwen families the checkpoint's config gives the shapes and
    the file the weights; a Mistral file is a `llama` file, read whole."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = None if family == "mistral" else AutoConfig.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _hf_tokens(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, `n` of them whatever they are (as ignore_eos)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_hf_layout_matches_transformers(family_ckpt: tuple[str, Path]) -> None:
    family, ckpt = family_ckpt
    ours, config = load_model(str(ckpt))
    assert config.model_type == family
    assert config.qkv_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    assert (config.sliding_window is not None) == (family == "mistral")
    hf = load_hf_model(ckpt)
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())
    torch.testing.assert_close(_logits(ours), _logits(hf), atol=1e-4, rtol=1e-4)
    assert nocache_greedy(ours, PROMPTS, 16) == [hf_greedy(hf, p, 16) for p in PROMPTS]


def test_the_engine_matches_transformers_greedy(family_ckpt: tuple[str, Path]) -> None:
    _, ckpt = family_ckpt
    hf = load_hf_model(ckpt)
    llm = LLM(str(ckpt), device="cpu", max_seq_len=256, kv_cache_backend="paged", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_tokens(hf, p, 16) for p in PROMPTS]
    assert llm.engine.leak_report() == []


def test_a_saved_model_round_trips_in_its_family(family_ckpt: tuple[str, Path], tmp_path: Path) -> None:
    from infer.models.loading.checkpoint import save_checkpoint
    family, ckpt = family_ckpt
    ours, _ = load_model(str(ckpt))
    saved = save_checkpoint(ours, tmp_path / "saved")
    torch.testing.assert_close(_logits(load_hf_model(saved)), _logits(ours), atol=1e-5, rtol=1e-5)
    assert load_model(str(saved))[1] == ours.config


def test_fp8_weights_stay_close_to_the_dense_model(family_ckpt: tuple[str, Path], tmp_path: Path) -> None:
    family, _ = family_ckpt
    ckpt = make_family_checkpoint(tmp_path / family, family, initializer_range=0.02)
    dense, _ = load_model(str(ckpt))
    fp8, _ = load_model(str(ckpt), quantization="fp8")
    a, b = _logits(dense).flatten(0, 1), _logits(fp8).flatten(0, 1)  # [T, V]
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.995 and not torch.equal(a, b)
    qkv = fp8.model.layers[0].self_attn.qkv_proj
    assert qkv.quantization == "fp8" and (qkv.bias is not None) == (family == "qwen2")


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0], ids=["F32", "F16", "Q8_0"])
def test_gguf_files_match_transformers(family_ckpt: tuple[str, Path], gguf_dir: Path, qtype: Q) -> None:
    family, ckpt = family_ckpt
    path = write_gguf(ckpt, gguf_dir / f"{family}-{qtype.name}.gguf", qtype)
    assert GGUFFile.open(path).architecture == {"mistral": "llama"}.get(family, family)
    ours, config = load_model(str(path))
    assert config.model_type == ("llama" if family == "mistral" else family)  # llama.cpp writes Mistral as llama
    reference = _transformers_gguf(path, ckpt, family)
    torch.testing.assert_close(_logits(ours), _logits(reference), atol=1e-4, rtol=1e-4)
    if qtype == Q.F32:  # the file holds the checkpoint's own weights
        torch.testing.assert_close(_logits(ours), _logits(load_hf_model(ckpt)), atol=1e-4, rtol=1e-4)
    assert nocache_greedy(ours, PROMPTS, 12) == [hf_greedy(reference, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_k_quant_gguf_files_match_transformers(tmp_path: Path, family: str) -> None:
    # rows of 256 (hidden, q_size and intermediate) so every matrix fits K-quant blocks
    ckpt = make_family_checkpoint(tmp_path / "ckpt", family, hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_gguf(ckpt, tmp_path / f"{family}-k.gguf", Q.F32, overrides=K_MIX)
    assert GGUFFile.open(path).tensors["blk.0.attn_q.weight"].ggml_type == Q.Q4_K
    ours, _ = load_model(str(path))
    reference = _transformers_gguf(path, ckpt, family)
    torch.testing.assert_close(_logits(ours), _logits(reference), atol=1e-4, rtol=1e-4)
    assert nocache_greedy(ours, PROMPTS, 12) == [hf_greedy(reference, p, 12) for p in PROMPTS]


def test_qwen2_with_untied_embeddings(tmp_path: Path) -> None:
    ckpt = make_family_checkpoint(tmp_path / "q", "qwen2", tie_word_embeddings=False)
    ours, config = load_model(str(ckpt))
    assert not config.tie_word_embeddings and ours.lm_head.weight is not ours.model.embed_tokens.weight
    torch.testing.assert_close(_logits(ours), _logits(load_hf_model(ckpt)), atol=1e-4, rtol=1e-4)


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path: Path) -> None:
    ckpt = make_family_checkpoint(tmp_path / "m", "mistral", sliding_window=64)
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*set max_seq_len <= 64"):
        LLM(str(ckpt), device="cpu", max_seq_len=128)
    llm = LLM(str(ckpt), device="cpu", max_seq_len=64)  # within the window: attention is the full one
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(temperature=0, max_tokens=8,
                                                                                     ignore_eos=True))
    assert out[0].outputs[0].token_ids == _hf_tokens(load_hf_model(ckpt), PROMPTS[0], 8)
    qwen = make_family_checkpoint(tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=32)
    with pytest.raises(ValueError, match="sliding window of 32 tokens"):
        load_model(str(qwen), max_seq_len=256)
