"""GGUF files: models loaded from them match transformers (the original checkpoint, and
transformers' own GGUF loader) for every supported tensor type, and every broken or
unsupported file is a clear error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers.checkpoints import hf_greedy, load_hf_model, make_checkpoint
from helpers.gguf_files import permute, write_gguf
from infer import LLM, SamplingParams
from infer.engine.loading import load_tokenizer
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.gguf.reader import GGUFFile
from infer.models.loading.gguf.weights import iter_hf_tensors, unpermute_rotary
from infer.models.loading.loader import load_model, model_shapes

IDS = torch.tensor([[5, 77, 123, 9, 300, 41, 2, 250, 18, 64, 99, 7]])  # [1, T]


def _logits(model: LlamaForCausalLM) -> torch.Tensor:
    """Ours: [1, T, V]."""
    with torch.no_grad():
        return model(IDS)


def _hf_logits(model: Any) -> torch.Tensor:
    """A transformers model's: [1, T, V]."""
    with torch.no_grad():
        return model(IDS).logits


def _transformers_gguf(path: Path, ckpt: Path | None = None) -> Any:
    """The reference: transformers' own GGUF loader (it dequantizes with the gguf library).

    It does not read llama.cpp's rope_freqs.weight (Llama 3 RoPE scaling), so for such a
    file the checkpoint's config is passed in; otherwise the config comes from the file.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = None if ckpt is None else LlamaConfig.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")  # no tokenizer.json beside the files


@pytest.fixture(scope="module")
def kquant_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 (hidden, q_size and intermediate), so every matrix fits K-quant blocks."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_k"), variant="b", hidden_size=256,
                           intermediate_size=256)


# --- parity ---------------------------------------------------------------------------

# "a": tied embeddings, Llama 3 RoPE scaling, 8 query heads over 2 KV heads;
# "b": untied, no scaling, 4 query heads over 2 KV heads
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("variant", ["a", "b"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_matches_transformers_gguf_loader(request: pytest.FixtureRequest, gguf_dir: Path, variant: str,
                                          qtype: Q) -> None:
    ckpt: Path = request.getfixturevalue(f"ckpt_{variant}")
    path = write_gguf(ckpt, gguf_dir / f"{variant}-{qtype.name}.gguf", qtype)
    ours, config = load_model(str(path))
    assert config.tie_word_embeddings == (variant == "a")
    assert (config.rope_freq_factors is not None) == (variant == "a")
    reference = _transformers_gguf(path, ckpt if variant == "a" else None)
    torch.testing.assert_close(_logits(ours), _hf_logits(reference), atol=1e-4, rtol=1e-4)
    llm = LLM(str(path), device="cpu")
    prompts = [llm.tokenizer.encode(text) for text in ("The quick brown fox", "def forward(self")]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_f32_file_matches_the_original_checkpoint_with_llama3_rope(ckpt_a: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_a, gguf_dir / "a-orig.gguf", Q.F32)
    ours, config = load_model(str(path))
    assert config.rope_freq_factors is not None
    assert config.rope_freq_factors[0] == 1.0 and config.rope_freq_factors[-1] == 8.0  # high / low bands
    torch.testing.assert_close(_logits(ours), _hf_logits(load_hf_model(ckpt_a)), atol=1e-4, rtol=1e-4)


def test_an_fp8_load_requantizes_the_dequantized_weights(ckpt_b: Path, gguf_dir: Path) -> None:
    # quantization="fp8" re-quantizes what the file holds: from an F32 file, exactly the FP8
    # model of the original checkpoint
    path = write_gguf(ckpt_b, gguf_dir / "b-fp8.gguf", Q.F32)
    ours, _ = load_model(str(path), quantization="fp8")
    reference, _ = load_model(str(ckpt_b), quantization="fp8")
    layers = [m for m in ours.linears().values() if m.quantization == "fp8"]
    assert layers and ours.quantization == "fp8"
    for a, b in zip(ours.linears().values(), reference.linears().values(), strict=True):
        if a.quantization == "fp8":
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            assert torch.equal(a.weight_scale, b.weight_scale)
    torch.testing.assert_close(_logits(ours), _logits(reference))


@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0], ids=["BF16", "Q8_0", "Q4_0"])
def test_quantized_files_are_lossy_but_close(ckpt_b: Path, gguf_dir: Path, qtype: Q) -> None:
    path = write_gguf(ckpt_b, gguf_dir / f"b-lossy-{qtype.name}.gguf", qtype)
    ours, _ = load_model(str(path))
    original = _hf_logits(load_hf_model(ckpt_b))
    error = (_logits(ours) - original).abs().max().item()
    assert error > 0  # the file's blocks were read, not the original weights
    if qtype != Q.Q4_0:  # 4-bit blocks of a tiny random model move logits a lot
        assert error < 0.05 * original.abs().max().item()


def test_k_quant_file_matches_transformers_gguf_loader(kquant_ckpt: Path, gguf_dir: Path) -> None:
    mix = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_K,
           "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K, "output": Q.Q5_K}
    path = write_gguf(kquant_ckpt, gguf_dir / "k-mix.gguf", Q.F32, overrides=mix)
    types = {t.name: t.ggml_type for t in GGUFFile.open(path).tensors.values()}
    assert {types["blk.1.attn_q.weight"], types["blk.0.ffn_down.weight"], types["output.weight"]} == {
        Q.Q4_K, Q.Q6_K, Q.Q5_K}
    ours, _ = load_model(str(path))
    torch.testing.assert_close(_logits(ours), _hf_logits(_transformers_gguf(path)), atol=1e-4, rtol=1e-4)


def test_unpermute_rotary_inverts_the_converter() -> None:
    weight = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of 8 rows
    permuted = torch.from_numpy(permute(weight.numpy(), heads=4))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, heads=4), weight)


def test_tensors_go_through_load_hf_weights_in_the_asked_dtype(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-names.gguf", Q.Q8_0)
    model, config = load_model(str(path), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    named = dict(iter_hf_tensors(GGUFFile.open(path), config, torch.device("cpu"), torch.float32,
                                 progress=False))
    assert set(named) == {name for name, _ in model.hf_state_dict()}  # HF names, the FP8 seam


def test_progress_bar_while_reading(ckpt_b: Path, gguf_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-bar.gguf", Q.Q4_0)
    model, config = load_model(str(path))
    list(iter_hf_tensors(GGUFFile.open(path), config, torch.device("cpu"), torch.float32, progress=True))
    assert "reading b-bar.gguf" in capsys.readouterr().err


def test_dummy_weights_take_the_file_shape(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-dummy.gguf", Q.Q8_0)
    model, config = load_model(str(path), load_format="dummy")
    assert config.hidden_size == 64 and config.num_key_value_heads == 2
    assert model.model.norm.weight[0].item() != 1.0  # the dummy init, not the file's norm


# --- errors ---------------------------------------------------------------------------


def test_unsupported_tensor_type_names_tensor_and_type(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-q5.gguf", Q.F16, overrides={"ffn_up": Q.Q5_0})
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight' is stored as Q5_0.*Q4_K"):
        load_model(str(path))


def test_an_unsupported_architecture_is_refused(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-gemma.gguf", Q.F16, architecture="gemma2")
    with pytest.raises(ValueError, match="'gemma2' model; infer runs the architectures llama, qwen2, qwen3"):
        load_model(str(path))
    with pytest.raises(ValueError, match="'gemma2' model"):
        load_tokenizer(str(path))


def test_mixture_of_experts_llama_is_refused(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-moe.gguf", Q.F16, edit=lambda w: w.add_expert_count(8))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(str(path))


def test_yarn_rope_scaling_is_refused(ckpt_b: Path, gguf_dir: Path) -> None:
    edit = lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # noqa: E731
    path = write_gguf(ckpt_b, gguf_dir / "b-yarn.gguf", Q.F16, edit=edit)
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [0.99, 0.6, 0.05, 30])
def test_truncated_file_is_a_clear_error(ckpt_b: Path, gguf_dir: Path, tmp_path: Path, keep: float) -> None:
    whole = write_gguf(ckpt_b, gguf_dir / "b-whole.gguf", Q.Q8_0).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(keep * len(whole)) if keep < 1 else int(keep)])
    with pytest.raises(ValueError, match="is truncated or corrupt.*download it again"):
        load_model(str(cut))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(str(path))


def test_safetensors_format_with_a_gguf_file(ckpt_b: Path, gguf_dir: Path) -> None:
    path = write_gguf(ckpt_b, gguf_dir / "b-fmt.gguf", Q.F16)
    with pytest.raises(ValueError, match="is a GGUF file, not safetensors"):
        load_model(str(path), load_format="safetensors")


def test_other_files_are_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(np.zeros(16, dtype=np.uint8).tobytes())
    with pytest.raises(FileNotFoundError, match="not a GGUF file"):
        load_model(str(path))


def test_rope_freq_factors_are_validated(ckpt_a: Path, gguf_dir: Path) -> None:
    _, config = load_model(str(write_gguf(ckpt_a, gguf_dir / "a-cfg.gguf", Q.F16)), load_format="dummy")
    with pytest.raises(ValueError, match="head_dim // 2 = 4"):
        dataclasses.replace(config, rope_freq_factors=(1.0, 2.0))
    with pytest.raises(ValueError, match="give one of them"):
        dataclasses.replace(config, rope_scaling=model_shapes["llama-3.2-1b"].rope_scaling)
    with pytest.raises(ValueError, match="config.json cannot express"):
        config.to_hf_dict()
