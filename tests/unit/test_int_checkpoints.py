"""Integer checkpoints (models/loading/quantized.py): GPTQ and AWQ written in their own
packing by the test helpers, compressed-tensors pack-quantized written by that library,
each loaded against a dense checkpoint of exactly its dequantized values (same matrices,
same logits, the same greedy tokens through the engine); and every unsupported or broken
file refused with a clear error before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.checkpoints import make_checkpoint
from helpers.int_checkpoints import edit_quantization_config, write_compressed_tensors, write_int_checkpoint
from infer import LLM, SamplingParams
from infer.models.loading.loader import load_model, read_model_config

IDS = torch.tensor([[5, 77, 123, 9, 300, 41, 2, 250, 18, 64, 99, 7]])  # [1, T]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 128 and 256 columns: groups of 32, 64 and 128 all divide them."""
    return make_checkpoint(tmp_path_factory.mktemp("int") / "dense", variant="b", hidden_size=128,
                           intermediate_size=256)


def _same_model(quantized: Path, reference: Path, bits: int, group: int) -> None:
    """The quantized checkpoint's layers keep their codes and equal the reference's dense
    matrices; logits and greedy tokens (engine, CPU) equal the reference's."""
    q, _ = load_model(str(quantized))
    ref, _ = load_model(str(reference))
    layers = [m for m in q.linears().values() if m.quantization is not None]
    assert len(layers) == 4 * q.config.num_hidden_layers and q.lm_head.quantization is None
    for layer, dense_layer in zip(q.linears().values(), ref.linears().values(), strict=True):
        if layer.quantization is not None:
            assert layer.method.layout.bits == bits and layer.method.layout.group_size == group
            assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape[1] == layer.in_features * bits // 8
            torch.testing.assert_close(layer.dense_weight(), dense_layer.dense_weight(), rtol=0, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(q(IDS), ref(IDS), rtol=0, atol=1e-4)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    prompts = [[5, 77, 123, 9], [300, 41, 2, 250, 18, 64]]
    outs = [[o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(prompt_token_ids=prompts,
                                                                                  sampling_params=greedy)]
            for path in (quantized, reference)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bits, group, symmetric, v1", [(4, 32, True, True), (4, 64, False, True),
                                                         (4, 128, True, False), (8, 64, False, False)])
def test_gptq_checkpoint_loads_its_codes(dense: Path, tmp_path: Path, bits: int, group: int, symmetric: bool,
                                         v1: bool) -> None:
    quantized, reference = write_int_checkpoint(dense, tmp_path / "gptq", "gptq", bits, group, symmetric, v1)
    _same_model(quantized, reference, bits, group)


@pytest.mark.parametrize("group", [32, 128])
def test_awq_checkpoint_loads_its_codes(dense: Path, tmp_path: Path, group: int) -> None:
    quantized, reference = write_int_checkpoint(dense, tmp_path / "awq", "awq", 4, group, symmetric=False)
    _same_model(quantized, reference, 4, group)


@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, True), (4, 64, False), (8, None, True)])
def test_compressed_tensors_pack_quantized_loads_its_codes(dense: Path, tmp_path: Path, bits: int,
                                                           group: int | None, symmetric: bool) -> None:
    quantized, reference = write_compressed_tensors(dense, tmp_path / "ct", bits, group, symmetric)
    q, _ = load_model(str(quantized))
    ref, _ = load_model(str(reference))
    for layer, dense_layer in zip(q.linears().values(), ref.linears().values(), strict=True):
        if layer.quantization is not None:
            assert layer.method.layout.bits == bits and layer.method.layout.group_size == (group or layer.in_features)
            # the library's fake-quantized values, up to float32 rounding of s * (q - z)
            torch.testing.assert_close(layer.dense_weight(), dense_layer.dense_weight(), rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(q(IDS), ref(IDS), rtol=0, atol=1e-4)


# --- errors, before any weight is read ---------------------------------------------------


@pytest.mark.parametrize("changes, words", [
    (dict(desc_act=True), "desc_act"),
    (dict(bits=3), "3-bit weights"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    (dict(group_size=33), "group_size 33"),
    (dict(lm_head=True), "quantized lm_head"),
])
def test_unsupported_gptq_settings_are_refused(dense: Path, tmp_path: Path, changes: dict, words: str) -> None:
    quantized, _ = write_int_checkpoint(dense, tmp_path / "gptq", "gptq", 4, 32)
    edit_quantization_config(quantized, **changes)
    with pytest.raises(ValueError, match=words):
        read_model_config(str(quantized))  # the config alone: nothing loaded


@pytest.mark.parametrize("changes, words", [(dict(version="gemv"), "version 'gemv'"), (dict(bits=8), "8-bit"),
                                            (dict(zero_point=False), "zero_point")])
def test_unsupported_awq_settings_are_refused(dense: Path, tmp_path: Path, changes: dict, words: str) -> None:
    quantized, _ = write_int_checkpoint(dense, tmp_path / "awq", "awq", 4, 32, symmetric=False)
    edit_quantization_config(quantized, **changes)
    with pytest.raises(ValueError, match=words):
        read_model_config(str(quantized))


def test_a_missing_scale_tensor_is_named_before_loading(dense: Path, tmp_path: Path) -> None:
    quantized, _ = write_int_checkpoint(dense, tmp_path / "gptq", "gptq", 4, 32)
    tensors = load_file(quantized / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.down_proj\.scales"):
        read_model_config(str(quantized))


def test_act_order_columns_are_refused(dense: Path, tmp_path: Path) -> None:
    quantized, _ = write_int_checkpoint(dense, tmp_path / "gptq", "gptq", 4, 32)
    tensors = load_file(quantized / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # groups no longer in column order
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="act-order"):
        load_model(str(quantized))


def test_compressed_tensors_act_order_is_refused(dense: Path, tmp_path: Path) -> None:
    quantized, _ = write_compressed_tensors(dense, tmp_path / "ct", 4, 32, True)
    import json
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="actorder 'group'"):
        read_model_config(str(quantized))


def test_an_integer_checkpoint_is_not_split_for_tensor_parallelism(dense: Path, tmp_path: Path) -> None:
    from infer.models.layers.shard import ModelShard
    quantized, _ = write_int_checkpoint(dense, tmp_path / "gptq", "gptq", 4, 32)
    with pytest.raises(ValueError, match="tensor parallelism does not split gptq checkpoints"):
        load_model(str(quantized), shard=ModelShard(0, 2))
