"""GGUF files whose quantized blocks stay codes (models/loading/gguf/repack.py, header.py): the
header read from the memory map equals the `gguf` library's reading; each kept type's codes
dequantize to what the library dequantizes; a model keeps its file's codes (a fused layer in
the layout that holds all its parts) and runs as the dequantized model does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from helpers.checkpoints import make_checkpoint
from helpers.gguf_files import write_gguf
from infer import LLM, SamplingParams
from infer.models.layers.int_embedding import QuantizedEmbedding, SharedWeights
from infer.models.layers.int_quant import IntLayout
from infer.models.loading.gguf.reader import GGUFFile
from infer.models.loading.gguf.repack import KEPT_LAYOUTS, repack
from infer.models.loading.gguf.weights import dequantize_tensor
from infer.models.loading.loader import build_model, open_reader

IDS = torch.tensor([[5, 77, 123, 9, 300, 41, 2, 250, 18, 64, 99, 7]])  # [1, T]
MIX = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q5_K,
       "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.Q6_K, "output": Q.Q4_K}


@pytest.fixture(scope="module")
def kquant_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows of 256 (hidden, q_size and intermediate), so every matrix fits K-quant blocks."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_kept"), variant="b", hidden_size=256,
                           intermediate_size=256)


@pytest.fixture(scope="module")
def mixed_file(kquant_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(kquant_ckpt, tmp_path_factory.mktemp("gguf_kept") / "mix.gguf", Q.F32, overrides=MIX)


def test_header_matches_the_gguf_library(mixed_file: Path) -> None:
    ours = GGUFFile.open(mixed_file)
    lib = gguf.GGUFReader(mixed_file)
    keys = [k for k in lib.fields if not k.startswith("GGUF.")]
    assert keys and all(ours.get(k) == lib.fields[k].contents() for k in keys)
    assert set(ours.tensors) == {t.name for t in lib.tensors}
    for t in lib.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type and mine.n_bytes == t.n_bytes
        assert mine.shape == tuple(reversed(t.shape.tolist())) and np.array_equal(mine.data, t.data)


@pytest.mark.parametrize("qtype", list(KEPT_LAYOUTS), ids=[t.name for t in KEPT_LAYOUTS])
def test_kept_codes_dequantize_as_the_library_does(mixed_file: Path, kquant_ckpt: Path, tmp_path: Path,
                                                   qtype: Q) -> None:
    path = write_gguf(kquant_ckpt, tmp_path / "one.gguf", Q.F32, overrides={"ffn_down": qtype})
    tensor = GGUFFile.open(path).tensors["blk.0.ffn_down.weight"]
    rows = repack(tensor)
    assert rows.layout == KEPT_LAYOUTS[qtype] and rows.packed.dtype == torch.uint8
    want = torch.from_numpy(np.array(dequantize_tensor(tensor)))
    # the library's own arithmetic (d * q + m in float32); Q6_K rounds its product once more
    tol = dict(rtol=1e-6, atol=1e-9) if qtype == Q.Q6_K else dict(rtol=0, atol=0)
    torch.testing.assert_close(rows.dequantize(), want, **tol)


def test_a_model_keeps_the_file_codes_and_runs_as_the_dequantized_one(mixed_file: Path) -> None:
    reader = open_reader(str(mixed_file))
    layouts = dict(reader.int_layouts)
    assert layouts["model.layers.0.self_attn.qkv_proj"] == IntLayout(8, 16)  # Q4_K q, k with a Q6_K v
    assert layouts["model.layers.0.mlp.gate_up_proj"] == IntLayout(8, 32)  # Q5_K gate, Q4_1 up
    assert layouts["model.layers.1.self_attn.o_proj"] == IntLayout(4, 32)
    kept = build_model(reader, torch.float32, torch.device("cpu"), None, None, layouts)
    dense = build_model(open_reader(str(mixed_file)), torch.float32, torch.device("cpu"), None, None, {})
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding) and kept.lm_head.quantization == "int4"
    dense_layers = {**dense.linears(), "model.embed_tokens": dense.model.embed_tokens}
    for name, layer in kept.linears().items():
        assert layer.quantization is not None, name
        want = dense_layers[name].weight
        torch.testing.assert_close(layer.dense_weight(), want, rtol=1e-6, atol=1e-9)
    with torch.no_grad():
        torch.testing.assert_close(kept(IDS), dense(IDS), rtol=1e-5, atol=1e-5)
    kept_bytes = sum(p.numel() * p.element_size() for p in kept.parameters())
    assert kept_bytes < 0.45 * sum(p.numel() * p.element_size() for p in dense.parameters())


def test_a_tied_file_keeps_its_embedding_codes_for_the_head(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "tied", variant="a", hidden_size=64)  # tied embeddings
    path = write_gguf(ckpt, tmp_path / "tied.gguf", Q.Q4_1, overrides={"token_embd": Q.Q8_0})
    llm = LLM(str(path), device="cpu")
    model = llm.engine.models.target
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head.method, SharedWeights)
    reader = open_reader(str(path))
    dense = build_model(reader, torch.float32, torch.device("cpu"), None, None, {})
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), dense(IDS), rtol=1e-5, atol=1e-5)
    prompts = [llm.tokenizer.encode(t) for t in ("The quick brown fox", "def forward(self")]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    from helpers.checkpoints import nocache_greedy
    want = nocache_greedy(dense, prompts, 12)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]
    assert [g[:len(w)] for g, w in zip(got, want, strict=True)] == want


def test_a_layer_with_a_dense_part_stays_dense(kquant_ckpt: Path, tmp_path: Path) -> None:
    path = write_gguf(kquant_ckpt, tmp_path / "f16v.gguf", Q.Q4_0, overrides={"attn_v": Q.F16})
    layouts = open_reader(str(path)).int_layouts
    assert "model.layers.0.self_attn.qkv_proj" not in layouts and "model.layers.0.mlp.down_proj" in layouts


def test_another_quantization_dequantizes_the_file(mixed_file: Path) -> None:
    from infer.models.loading.loader import load_model
    model, _ = load_model(str(mixed_file), quantization="int4")  # re-quantized from the dequantized values
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.method.layout == IntLayout(4, 128)
