"""FP8 weights (models/layers/fp8.py, models/layers/linear.py): the per-channel E4M3 bound, an
FP8 model against its dense twin, compressed-tensors checkpoints made by that library,
greedy parity of speculation with an FP8 draft, and the errors a user can cause."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.checkpoints import make_checkpoint
from infer import EngineConfig
from infer.models.layers.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8_rows
from infer.models.layers.linear import make_linear
from infer.models.loading.loader import load_model
from infer.models.loading.quantized import checkpoint_quantization


def test_quantize_dequantize_error_is_within_the_e4m3_bound_per_channel():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-3, 2, 64)[:, None]  # rows over five decades
    w[3] = 0.0  # an all-zero row keeps a finite scale
    q, scale = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    back = dequantize_fp8(q, scale, torch.float32)
    # E4M3: 3 mantissa bits (half a step: 2^-4 relative) for normals; below 2^-6 the step is 2^-9
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert torch.allclose(back.abs().amax(1)[w.abs().amax(1) > 0], w.abs().amax(1)[w.abs().amax(1) > 0], rtol=1e-6)
    assert (q.float().abs().amax(1)[w.abs().amax(1) > 0] == FP8_MAX).all()  # each row uses the full range
    assert back[3].abs().sum() == 0


def test_an_fp8_linear_computes_the_dense_layer_of_its_dequantized_weight():
    torch.manual_seed(1)
    dense = torch.randn(48, 32)
    layer = make_linear(32, 48, "fp8")
    layer.load_rows(dense[:16], 0)
    layer.load_rows(dense[16:], 16)  # a fused matrix filled in two blocks
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), x @ layer.dense_weight(torch.float32).t())
    assert torch.allclose(layer.dense_weight(torch.float32), dense, rtol=0.07, atol=1e-3)
    with pytest.raises(ValueError, match="shape"):
        layer.load_rows(torch.randn(16, 31), 0)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        make_linear(32, 48, None).load_rows(layer.weight, None)


def test_fp8_weights_are_parameters_that_keep_their_storage_through_to():
    # the FP8 weight and its scale are parameters, as a dense layer's weight is: .to(dtype)
    # converts the model's dtype and leaves the quantized storage as it is
    layer = make_linear(32, 48, "fp8")
    layer.load_rows(torch.randn(48, 32), None)
    before = layer.weight.detach().view(torch.uint8).clone(), layer.weight_scale.detach().clone()
    assert {n for n, _ in layer.named_parameters()} == {"weight", "weight_scale"}
    assert not any(p.requires_grad for p in layer.parameters()) and list(layer.buffers()) == []
    layer = layer.to(torch.float16).to(torch.float64).float()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.view(torch.uint8), before[0]) and torch.equal(layer.weight_scale, before[1])
    dense = make_linear(32, 48, None).to(torch.float16)
    assert dense.weight.dtype == torch.float16 and dense.quantization is None and layer.quantization == "fp8"
    meta = make_linear(32, 48, "fp8").to(torch.bfloat16).to_empty(device="cpu")
    assert meta.weight.dtype == torch.float8_e4m3fn and meta.weight_scale.dtype == torch.float32


@pytest.mark.parametrize("variant", ["a", "b"])
def test_fp8_model_logits_agree_with_the_dense_model(tmp_path, variant):
    # weights at a trained model's scale (std 0.02); the shared test checkpoints' std 0.2
    # makes attention so peaked that any perturbation moves their logits a lot
    ckpt = make_checkpoint(tmp_path / variant, variant=variant, initializer_range=0.02)
    dense, _ = load_model(str(ckpt), dtype="float32")
    fp8, _ = load_model(str(ckpt), dtype="float32", quantization="fp8")
    ids = torch.randint(0, dense.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = dense(ids).flatten(0, 1), fp8(ids).flatten(0, 1)  # [48, V]
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.999
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.998 and not torch.equal(a, b)
    layers = fp8.linears().values()
    assert sum(m.quantization == "fp8" for m in layers) == 4 * fp8.config.num_hidden_layers
    assert fp8.lm_head.quantization is None  # lm_head stays in the model's dtype
    assert next(fp8.parameters()).dtype == torch.float32  # the embedding: the model's dtype


def test_weight_bytes_count_fp8_layers_at_one_byte_a_weight(tmp_path):
    from infer.engine.step_costs import weight_bytes
    ckpt = make_checkpoint(tmp_path / "w", variant="a")
    dense, _ = load_model(str(ckpt), dtype="float32")
    fp8, _ = load_model(str(ckpt), dtype="float32", quantization="fp8")
    layers = [m for m in fp8.linears().values() if m.quantization == "fp8"]
    quantized = sum(m.weight.numel() for m in layers)  # FP8 bytes; plus a float32 scale a row
    expected = weight_bytes(dense) - 4 * quantized + quantized + 4 * sum(m.weight.shape[0] for m in layers)
    assert quantized > 0 and weight_bytes(fp8) == expected


def test_the_fp8_demo_target_agrees_with_the_dense_one_teacher_forced():
    # a trained model: top-1 agreement of the next-token argmax over real text
    from infer.engine.loading import DEMO_TARGET
    from infer.tokenization import Tokenizer
    text = (DEMO_TARGET / "README.md").read_text()[:3000] + "\ndef fibonacci(n):\n    if n < 2:\n        return n\n"
    ids = torch.tensor([Tokenizer.from_pretrained(DEMO_TARGET).encode(text)[:512]])
    dense, _ = load_model(str(DEMO_TARGET), dtype="float32")
    fp8, _ = load_model(str(DEMO_TARGET), dtype="float32", quantization="fp8")
    with torch.no_grad():
        a, b = dense(ids)[0], fp8(ids)[0]  # [T, V]
    agreement = (a.argmax(-1) == b.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean")
    assert agreement >= 0.97 and kl < 0.02


def _compressed_tensors_checkpoint(src, dst):
    """The checkpoint quantized to FP8 per channel by the compressed-tensors library itself."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], format="float-quantized")
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # the observer's min-max scale, as llm-compressor computes it
            module.weight_scale.data.copy_(module.weight.data.abs().amax(1, keepdim=True) / FP8_MAX)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def test_a_compressed_tensors_checkpoint_loads_as_quantizing_at_load_does(tmp_path):
    ckpt = make_checkpoint(tmp_path / "dense", variant="b")
    stored = _compressed_tensors_checkpoint(ckpt, tmp_path / "fp8")
    raw = json.loads((stored / "config.json").read_text())
    assert checkpoint_quantization(raw) == "fp8"
    loaded, _ = load_model(str(stored), dtype="float32")  # FP8 because the checkpoint is
    quantized, _ = load_model(str(ckpt), dtype="float32", quantization="fp8")
    assert loaded.quantization == "fp8"
    for (name, a), b in zip(loaded.linears().items(), quantized.linears().values(), strict=True):
        if a.quantization == "fp8":
            assert torch.equal(a.weight_scale, b.weight_scale), name
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), name
    ids = torch.randint(0, loaded.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), quantized(ids))


@pytest.mark.parametrize("kwargs, words", [
    (dict(quantization="int8"), "quantization must be None or 'fp8'"),
    (dict(draft_quantization="fp8", use_speculative_decoding=False), "draft_quantization configures speculative"),
    (dict(draft_quantization="fp8", use_speculative_decoding=True, speculative_method="ngram"),
     "draft_quantization applies to a draft model"),
])
def test_wrong_quantization_settings_are_clear_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "only 8-bit float weights"),
    ({"quant_method": "compressed-tensors", "ignore": ["lm_head", "model.layers.0.mlp.down_proj"],
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     r"ignore list \['model.layers.0.mlp.down_proj'\]"),
])
def test_an_unsupported_quantization_config_is_an_error_naming_it(tmp_path, qc, words):
    ckpt = make_checkpoint(tmp_path / "m", variant="b")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=words):
        load_model(str(ckpt))


def test_fp8_weights_in_a_dense_model_or_without_scales_are_errors(tmp_path):
    stored = _compressed_tensors_checkpoint(make_checkpoint(tmp_path / "d", variant="b"), tmp_path / "q")
    from safetensors.torch import load_file, save_file
    tensors = load_file(stored / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, stored / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj.weight_scale"):
        load_model(str(stored))
