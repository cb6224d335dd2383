"""Loading and saving checkpoints: sharding, round trips through transformers, dtypes,
dummy weights of real shapes, and a clear error for every broken input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers.checkpoints import copy_checkpoint, load_hf_model
from infer.models.loading.checkpoint import plan_shards, save_checkpoint
from infer.models.loading.loader import load_model, model_shapes
from infer.models.loading.readers import DUMMY_LOGIT_GAIN, resolve_model_path

IDS = torch.tensor([[5, 77, 123, 9, 300, 41, 2, 250, 18, 64, 99, 7]])  # [1, T]


def _logits(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


# --- saving and sharding --------------------------------------------------------------


def test_sharded_save_loads_with_identical_logits(ckpt_a: Path, tmp_path: Path) -> None:
    model, _ = load_model(str(ckpt_a))
    out = save_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    stored: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                stored[key] = shard.name
                total += f.get_tensor(key).nbytes
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == total
    assert "lm_head.weight" not in stored  # tied: saved once, as embed_tokens
    reloaded, _ = load_model(str(out))
    assert torch.equal(_logits(reloaded), _logits(model))


def test_single_file_save_when_it_fits(ckpt_b: Path, tmp_path: Path) -> None:
    model, _ = load_model(str(ckpt_b))
    out = save_checkpoint(model, tmp_path / "single", generation_config={"temperature": 0.7})
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert "lm_head.weight" in load_file(str(out / "model.safetensors"))  # untied: stored
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["temperature"] == 0.7 and gen["eos_token_id"] == model.config.eos_token_ids[0]


@pytest.mark.parametrize("variant", ["a", "b", "c"])
def test_saved_checkpoint_loads_in_transformers(variant: str, request: pytest.FixtureRequest,
                                                tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(f"ckpt_{variant}")
    model, _ = load_model(str(src))
    out = save_checkpoint(model, tmp_path / "saved", max_shard_bytes=60_000)
    hf = load_hf_model(out)
    assert (_logits(hf) - _logits(model)).abs().max().item() <= 1e-4
    assert (_logits(hf) - _logits(load_hf_model(src))).abs().max().item() <= 1e-5


def test_save_in_bfloat16(ckpt_a: Path, tmp_path: Path) -> None:
    model, _ = load_model(str(ckpt_a))
    out = save_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    reloaded, _ = load_model(str(out))  # auto: the config's dtype
    assert reloaded.lm_head.weight.dtype == torch.bfloat16


def test_plan_shards_packs_in_order() -> None:
    shards = plan_shards({"a": 40, "b": 40, "c": 30, "d": 200, "e": 10}, max_shard_bytes=100)
    assert [s.names for s in shards] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [s.nbytes for s in shards] == [80, 30, 200, 10]


# --- dtypes -----------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "expected"), [
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16),
    ("float16", torch.float16), ("fp32", torch.float32), ("float32", torch.float32),
    (torch.bfloat16, torch.bfloat16), ("auto", torch.float32),
])
def test_dtype_choices(ckpt_a: Path, dtype: Any, expected: torch.dtype) -> None:
    model, _ = load_model(str(ckpt_a), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.rotary.inv_freq.dtype == torch.float32
    reference, _ = load_model(str(ckpt_a), dtype=torch.float32)
    tol = 1e-5 if expected == torch.float32 else 0.15
    assert (_logits(model).float() - _logits(reference)).abs().mean().item() <= tol / 3


def test_auto_dtype_follows_config(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    _edit_config(directory, torch_dtype="bfloat16", dtype=None)
    model, _ = load_model(str(directory))
    assert model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int8])
def test_unsupported_dtype_rejected(ckpt_a: Path, dtype: Any) -> None:
    with pytest.raises(ValueError, match=r"dtype .* not supported.*bf16"):
        load_model(str(ckpt_a), dtype=dtype)


def test_model_is_frozen_and_in_eval_mode(ckpt_b: Path) -> None:
    model, config = load_model(ckpt_b)  # a Path works as well as a str
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert config == model.config


# --- dummy weights ------------------------------------------------------------------------


def test_dummy_weights_from_config_only(ckpt_a: Path, tmp_path: Path) -> None:
    directory = tmp_path / "config_only"
    directory.mkdir()
    (directory / "config.json").write_text((ckpt_a / "config.json").read_text())
    model, config = load_model(str(directory), load_format="dummy")
    again, _ = load_model(str(directory), load_format="dummy")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        if name == "model.norm.weight":  # logit gain: peaked next-token distributions
            assert torch.equal(param, torch.full_like(param, DUMMY_LOGIT_GAIN)), name
        elif name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert 0.015 < param.std().item() < 0.025 and abs(param.mean().item()) < 0.01, name
    assert torch.equal(_logits(model), _logits(again))  # fixed seed
    assert torch.isfinite(_logits(model)).all()


def test_dummy_load_ignores_weight_files(ckpt_b: Path) -> None:
    real, _ = load_model(str(ckpt_b))
    dummy, _ = load_model(str(ckpt_b), load_format="dummy")
    assert not torch.equal(real.lm_head.weight, dummy.lm_head.weight)


# Parameter counts published for the released models (Hugging Face model pages).
PUBLISHED_PARAMS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
                    "llama-3.1-8b": 8_030_261_248}


@pytest.mark.parametrize("shape", sorted(PUBLISHED_PARAMS))
def test_named_dummy_shapes(shape: str) -> None:
    model, config = load_model(f"dummy:{shape}", dtype="bf16", device="meta")
    assert config == model_shapes[shape]
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[shape]
    assert config.vocab_size == 128256 and config.rope_theta == 500000.0
    assert config.eos_token_ids == (128001, 128008, 128009) and config.bos_token_id == 128000
    assert config.tie_word_embeddings == (shape != "llama-3.1-8b")
    assert config.rope_scaling is not None
    assert config.rope_scaling.factor == (8.0 if shape == "llama-3.1-8b" else 32.0)


def test_bare_shape_name_with_dummy_format() -> None:
    model, config = load_model("llama-3.2-1b", load_format="dummy", device="meta")
    assert config == model_shapes["llama-3.2-1b"] and model.lm_head.weight.is_meta


def test_named_dummy_shape_errors() -> None:
    with pytest.raises(ValueError, match="unknown dummy shape.*llama-3.2-1b"):
        load_model("dummy:llama-9b", device="meta")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model("dummy:llama-3.2-1b", load_format="safetensors", device="meta")
    with pytest.raises(ValueError, match="load_format 'pickle'"):
        load_model("dummy:llama-3.2-1b", load_format="pickle")


# --- broken inputs -------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./no-such-model-dir")


def test_path_to_a_file(ckpt_a: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is a file"):
        load_model(str(ckpt_a / "config.json"))


def test_missing_config(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(directory))


def test_corrupt_config(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(directory))


def test_no_weight_files(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        load_model(str(directory))
    torch.save({}, directory / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="convert them to safetensors"):
        load_model(str(directory))


def test_index_references_missing_shard(ckpt_a: Path, tmp_path: Path) -> None:
    model, _ = load_model(str(ckpt_a))
    out = save_checkpoint(model, tmp_path / "sharded", max_shard_bytes=40_000)
    victim = sorted(out.glob("model-*-of-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing shard.*{victim.name}"):
        load_model(str(out))


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight",
                                     "model.layers.0.mlp.up_proj.weight", "model.norm.weight"])
def test_missing_tensor(ckpt_a: Path, tmp_path: Path, dropped: str) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors[dropped]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing 1 tensor.*{dropped}"):
        load_model(str(directory))


def test_unexpected_tensor(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.7.self_attn.q_proj.weight'"):
        load_model(str(directory))


def test_tensor_shape_mismatch(ckpt_b: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_b, tmp_path / "m")
    _edit_config(directory, intermediate_size=192)  # weights were saved with 160
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
        load_model(str(directory))


@pytest.mark.parametrize("changes", [
    {"architectures": ["MistralForCausalLM"], "model_type": "llama"},  # a class of another family
    {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
])
def test_unsupported_architecture(ckpt_a: Path, tmp_path: Path, changes: dict[str, Any]) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    _edit_config(directory, **changes)
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(str(directory))


def test_config_missing_required_field(ckpt_a: Path, tmp_path: Path) -> None:
    directory = copy_checkpoint(ckpt_a, tmp_path / "m")
    raw = json.loads((directory / "config.json").read_text())
    del raw["hidden_size"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="required field 'hidden_size'"):
        load_model(str(directory))


# --- hub ids --------------------------------------------------------------------------------


def test_hub_unreachable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: Any, **kwargs: Any) -> str:
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="hub unreachable.*local directory"):
        load_model("meta-llama/Llama-3.2-1B")


def test_hub_id_downloads_config_weights_and_tokenizer(monkeypatch: pytest.MonkeyPatch, ckpt_c: Path) -> None:
    calls: list[tuple[str, list[str]]] = []

    def fake_download(repo_id: str, allow_patterns: list[str], **kwargs: Any) -> str:
        calls.append((repo_id, allow_patterns))
        return str(ckpt_c)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, _ = load_model("org/tiny-llama")
    assert calls and calls[0][0] == "org/tiny-llama"
    assert {"*.json", "*.safetensors", "tokenizer.model"} <= set(calls[0][1])
    assert model.config.head_dim == 32


# --- the test checkpoints themselves ----------------------------------------------------------


def test_helper_checkpoint_is_a_complete_model_directory(ckpt_a: Path) -> None:
    from tokenizers import Tokenizer

    names = {p.name for p in ckpt_a.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    tok = Tokenizer.from_file(str(ckpt_a / "tokenizer.json"))
    config = json.loads((ckpt_a / "config.json").read_text())
    tok_config = json.loads((ckpt_a / "tokenizer_config.json").read_text())
    gen = json.loads((ckpt_a / "generation_config.json").read_text())
    assert config["vocab_size"] == tok.get_vocab_size()
    text = "Once upon a time, naïve robots said: 42!"
    enc = tok.encode(text)
    assert enc.ids[0] == config["bos_token_id"] == tok.token_to_id(tok_config["bos_token"])
    assert tok.decode(enc.ids, skip_special_tokens=True) == text  # byte-level: lossless
    assert gen["eos_token_id"] == tok.token_to_id(tok_config["eos_token"])
    assert "add_generation_prompt" in tok_config["chat_template"]
