"""Integer weights (models/layers/int_quant.py, models/layers/linear.py `IntWeights`,
models/layers/int_embedding.py):
round-to-nearest bounds, the packing, lossless layout conversion, a layer that is its
dequantized matrix, whole models quantized at load (the head and a tied embedding in 8
bits), their bytes, quality on the trained demo target, and an int4 draft's speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.checkpoints import make_checkpoint
from infer import LLM, EngineConfig, SamplingParams
from infer.models.layers.int_embedding import QuantizedEmbedding, SharedWeights
from infer.models.layers.int_quant import (IntLayout, PackedRows, default_group, dequantize_int, pack_codes,
                                           quantize_rtn, unpack_codes)
from infer.models.layers.linear import IntWeights, LinearBase, make_linear
from infer.models.loading.loader import load_model


def test_round_to_nearest_is_within_half_a_step_of_every_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 256) * torch.logspace(-3, 1, 24)[:, None]
    w[5, :64] = 0.7  # a constant group: exact
    for bits in (4, 8):
        layout = IntLayout(bits, 64)
        packed, scales, offsets = quantize_rtn(w, layout, torch.float32)
        assert packed.shape == (24, 256 * bits // 8) and scales.shape == offsets.shape == (24, 4)
        back = dequantize_int(packed, scales, offsets, layout, torch.float32)
        step = scales.repeat_interleave(64, dim=1)
        assert ((back - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
        groups = w.view(24, 4, 64)
        torch.testing.assert_close(offsets, groups.amin(-1))  # the group's minimum is a code's value
        assert torch.equal(back[5, :64], w[5, :64])


def test_codes_pack_two_a_byte_even_column_low() -> None:
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert torch.equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(unpack_codes(packed, 4), codes)
    wide = torch.randint(0, 256, (3, 10), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(wide, 8), 8), wide)


def test_packed_rows_convert_to_wider_codes_and_finer_groups_without_loss() -> None:
    packed, scales, offsets = quantize_rtn(torch.randn(8, 64), IntLayout(4, 32), torch.float32)
    rows = PackedRows(IntLayout(4, 32), packed, scales, offsets)
    wider = rows.to_layout(IntLayout(8, 16), torch.device("cpu"), torch.float32)
    assert wider.packed.shape == (8, 64) and wider.scales.shape == (8, 4)
    assert torch.equal(wider.dequantize(), rows.dequantize())
    for layout in (IntLayout(4, 64), IntLayout(8, 64)):
        with pytest.raises(ValueError, match="without loss"):
            rows.to_layout(layout, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        PackedRows(IntLayout(4, 32), packed, scales[:, :1], offsets)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        IntLayout(3, 32)
    assert default_group(576) == 64 and default_group(160) == 32
    with pytest.raises(ValueError, match="divisible by 16"):
        default_group(72)


def test_an_int_layer_is_its_dequantized_matrix() -> None:
    torch.manual_seed(1)
    dense = torch.randn(48, 64)
    layer = make_linear(64, 48, "int4")
    layer.load_rows(dense[:16], 0)
    layer.load_rows(dense[16:], 16)  # a fused matrix filled in two blocks
    assert layer.quantization == "int4" and [n for n, _ in layer.named_parameters()] == ["scales", "offsets",
                                                                                        "qweight"]
    x = torch.randn(5, 64)
    w = layer.dense_weight()
    torch.testing.assert_close(layer(x), x @ w.t())
    assert layer(x[:0]).shape == (0, 48)  # a pass asking for no rows (a catch-up without logits)
    assert (w - dense).abs().max() < 0.5 * layer.scales.max()
    half = layer.to(torch.float16)
    assert half.qweight.dtype == torch.uint8 and half.scales.dtype == torch.float16
    tall = make_linear(64, 3000, "int8")  # more values than a CPU call dequantizes at a time
    tall.load_rows(torch.randn(3000, 64), None)
    torch.testing.assert_close(tall(x), x @ tall.dense_weight().t())
    ids = torch.tensor([[3, 0], [47, 5]])
    table = LinearBase(64, 48, IntWeights(IntLayout(4, 64)))
    table.load_rows(dense, None)
    torch.testing.assert_close(table.method.rows(table, ids), table.dense_weight()[ids])
    with pytest.raises(ValueError, match="shape"):
        layer.load_rows(torch.randn(16, 63), 0)
    with pytest.raises(ValueError, match="quantization='fp8'"):
        layer.load_rows(torch.randn(16, 64).to(torch.float8_e4m3fn), 0)
    packed = PackedRows(IntLayout(4, 64), *quantize_rtn(dense, IntLayout(4, 64), torch.float32))
    with pytest.raises(ValueError, match="int4 codes"):
        make_linear(64, 48, None).load_rows(packed, None)


@pytest.mark.parametrize("variant", ["a", "b"])
def test_int4_model_keeps_codes_and_tracks_the_dense_model(tmp_path: Path, variant: str) -> None:
    ckpt = make_checkpoint(tmp_path / variant, variant=variant, initializer_range=0.02)
    dense, _ = load_model(str(ckpt), dtype="float32")
    q, _ = load_model(str(ckpt), dtype="float32", quantization="int4")
    projections = [m for m in q.linears().values() if m.quantization == "int4"]
    assert len(projections) == 4 * q.config.num_hidden_layers
    if variant == "a":  # tied: the embedding holds 8-bit codes, the head reads them
        assert isinstance(q.model.embed_tokens, QuantizedEmbedding) and isinstance(q.lm_head.method, SharedWeights)
        assert q.model.embed_tokens.quantization == "int8" and q.lm_head.quantization == "int8"
    else:  # untied: an 8-bit head, the embedding (one row read a token) in the model's dtype
        assert isinstance(q.model.embed_tokens, torch.nn.Embedding) and q.lm_head.quantization == "int8"
    assert next(q.parameters()).dtype == torch.float32  # what the engine reads as the model's dtype
    ids = torch.randint(0, dense.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = dense(ids).flatten(0, 1), q(ids).flatten(0, 1)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.99 and not torch.equal(a, b)
    assert [n for n, _ in q.hf_state_dict()] == [n for n, _ in dense.hf_state_dict()]
    from infer.models.loading.checkpoint import save_checkpoint
    twin, _ = load_model(str(save_checkpoint(q, tmp_path / "twin")), dtype="float32")  # dequantized, dense
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).flatten(0, 1), b, rtol=1e-5, atol=1e-5)


def test_weight_bytes_count_codes_scales_and_offsets(tmp_path: Path) -> None:
    from infer.engine.step_costs import weight_bytes
    q, _ = load_model(str(make_checkpoint(tmp_path / "w", variant="a")), dtype="float32", quantization="int4")
    layers = [m for m in q.linears().values() if isinstance(m.method, IntWeights)]
    codes = sum(m.qweight.numel() + 4 * (m.scales.numel() + m.offsets.numel()) for m in layers)
    norms = sum(p.numel() * 4 for n, p in q.named_parameters() if n.endswith("norm.weight"))
    assert weight_bytes(q) == codes + norms  # (the tied head counted once, in the embedding)
    assert codes < 0.4 * 4 * sum(m.in_features * m.out_features for m in layers)


def test_engine_config_takes_int4() -> None:
    assert EngineConfig(quantization="int4").quantization == "int4"
    config = EngineConfig(use_speculative_decoding=True, draft_quantization="int4")
    assert config.draft_quantization == "int4"
    with pytest.raises(ValueError, match="'fp8' or 'int4'"):
        EngineConfig(quantization="int3")


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# read a file and count its words\n"]


def test_int4_demo_target_picks_the_dense_greedy_tokens() -> None:
    """The trained demo target quantized at load: along the dense model's own greedy
    continuation (32 tokens of each prompt), the int4 model's greedy choice is the dense
    one at 70% of the positions or more."""
    from infer.engine.loading import DEMO_TARGET
    from infer.tokenization import Tokenizer
    tok = Tokenizer.from_pretrained(DEMO_TARGET)
    dense = LLM(device="cpu")
    outs = dense.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    q, _ = load_model(str(DEMO_TARGET), dtype="float32", quantization="int4")
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        prefix, new = tok.encode(prompt), out.outputs[0].token_ids
        ids = torch.tensor([prefix + new[:-1]])
        with torch.no_grad():
            picks = q(ids)[0, len(prefix) - 1:].argmax(-1)  # [len(new)]
        agree += int((picks == torch.tensor(new)).sum())
        total += len(new)
    assert total >= 32 * 3 and agree / total >= 0.7


def test_an_int4_draft_keeps_greedy_output_exact() -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(device="cpu").generate(PROMPTS[:3], greedy)
    llm = LLM(device="cpu", use_speculative_decoding=True, draft_quantization="int4", spec_length=3)
    spec = llm.generate(PROMPTS[:3], greedy)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    draft = llm.engine.models.draft
    assert {m.quantization for m in draft.linears().values()} == {"int4", "int8"}
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_int4_weights_in_every_family(tmp_path: Path, family: str) -> None:
    from helpers.checkpoints import make_family_checkpoint
    ckpt = make_family_checkpoint(tmp_path / family, family, initializer_range=0.02)
    dense, _ = load_model(str(ckpt))
    q, _ = load_model(str(ckpt), quantization="int4")
    ids = torch.randint(0, dense.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = dense(ids)[0], q(ids)[0]  # [T, V]
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() >= 0.95 and not torch.equal(a, b)
    qkv = q.model.layers[0].self_attn.qkv_proj
    assert qkv.quantization == "int4" and (qkv.bias is not None) == (family == "qwen2")


def test_a_tensor_parallel_rank_quantizes_its_part_as_the_whole_model_does(tmp_path: Path) -> None:
    from infer.models.layers.shard import ModelShard
    ckpt = make_checkpoint(tmp_path / "tp", variant="b", hidden_size=128, intermediate_size=256)
    whole, _ = load_model(str(ckpt), quantization="int4")
    rank, _ = load_model(str(ckpt), quantization="int4", shard=ModelShard(1, 2))
    down, part = whole.model.layers[0].mlp.down_proj, rank.model.layers[0].mlp.down_proj  # row-parallel
    assert part.quantization == "int4" and part.parallel.kind == "row" and part.in_features == 128
    assert torch.equal(part.dense_weight(), down.dense_weight()[:, 128:])  # groups of 128 within each rank's part
    gate_up = rank.model.layers[0].mlp.gate_up_proj  # column-parallel: its rows of gate and of up
    assert torch.equal(gate_up.dense_weight()[:128], whole.model.layers[0].mlp.gate_up_proj.dense_weight()[128:256])
    assert rank.lm_head.quantization is None  # (a split model's head stays dense)
