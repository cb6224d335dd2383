"""Tensor parallelism's pieces, in one process: which part of each tensor a rank's model
holds (its layers built parallel) and reads (and that it reads nothing else), the shard's
model against the whole model's slices, dummy weights that shard exactly, devices per rank,
the control messages' encoding, the bench's kernel classification."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.models.loading.readers as readers
from infer_bench.collectives import collective_kind, summarize_kernels
from infer.cache.forward_batch import DeviceIds, Row, plan_batch
from infer.distributed.channel import decode, encode
from infer.distributed.group import plan_devices, torchrun_device
from infer.distributed.protocol import Invoke, Message, PoolChanges
from infer.engine.config import EngineConfig
from infer.models.config import ModelConfig
from infer.models.layers.linear import TiedRows
from infer.models.layers.parallel import Parallel, TensorPart, VocabParallelEmbedding
from infer.models.layers.shard import ModelShard
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.loader import load_model

CONFIG = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=8)


def _meta_model(config: ModelConfig, shard: ModelShard | None, quantization: str | None = None) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(config, quantization, shard)


@pytest.mark.parametrize(("name", "shape", "part"), [
    ("model.layers.0.self_attn.q_proj.weight", (64, 64), TensorPart(0, 32, 64)),
    ("model.layers.3.self_attn.k_proj.weight", (32, 64), TensorPart(0, 16, 32)),
    ("model.layers.0.mlp.up_proj.weight", (160, 64), TensorPart(0, 80, 160)),
    ("model.layers.0.mlp.gate_proj.weight_scale", (160, 1), TensorPart(0, 80, 160)),  # per row
    ("model.layers.0.self_attn.v_proj.weight_scale", (), None),  # one scale for the tensor
    ("model.layers.0.self_attn.o_proj.weight", (64, 64), TensorPart(1, 32, 64)),
    ("model.layers.0.mlp.down_proj.weight", (64, 160), TensorPart(1, 80, 160)),
    ("model.layers.0.mlp.down_proj.weight_scale", (64,), None),  # rows are whole on every rank
    ("model.embed_tokens.weight", (384, 64), TensorPart(0, 192, 384)),
    ("lm_head.weight", (384, 64), TensorPart(0, 192, 384)),
    ("model.layers.0.input_layernorm.weight", (64,), None),
    ("model.norm.weight", (64,), None),
])
def test_each_tensor_splits_along_its_layers_parallel_dimension(name: str, shape: tuple[int, ...],
                                                                part: TensorPart | None) -> None:
    # the part a rank reads is the one its model's layer (built parallel) holds
    parts = _meta_model(CONFIG, ModelShard(1, 2, embedding="vocab_parallel")).checkpoint_parts()
    assert parts(name, shape) == part
    replicated = _meta_model(CONFIG, ModelShard(1, 2)).checkpoint_parts()  # default: embedding whole
    if name == "model.embed_tokens.weight":
        assert replicated(name, shape) is None
    assert _meta_model(CONFIG, None).checkpoint_parts()(name, shape) is None  # one rank: all of it


def test_shapes_that_do_not_divide_are_errors_naming_them() -> None:
    config = ModelConfig(vocab_size=385, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\).* not divisible by 3"):
        ModelShard(0, 3, lm_head="replicated").check(config)
    with pytest.raises(ValueError, match=r"vocab_size \(385\) is not divisible by 2.*'replicated'"):
        _meta_model(config, ModelShard(0, 2))  # (building the rank's model checks first)
    _meta_model(config, ModelShard(0, 2, lm_head="replicated"))  # the vocabulary stays whole: fine
    tied = ModelConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties lm_head"):
        ModelShard(0, 2, embedding="vocab_parallel", lm_head="replicated").check(tied)
    with pytest.raises(ValueError, match="cannot be split"):
        _meta_model(CONFIG, ModelShard(1, 2)).checkpoint_parts()("model.layers.0.self_attn.q_proj.weight", (63, 64))
    with pytest.raises(ValueError, match="one rank holds the whole model"):
        ModelShard(0, 1)


class _Slice:
    """A safetensors slice that records which rows / columns were read."""

    def __init__(self, tensor: torch.Tensor, reads: list[tuple[str, Any]], name: str) -> None:
        self.tensor, self.reads, self.name = tensor, reads, name

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:  # noqa: ANN401 - as safetensors
        self.reads.append((self.name, index))
        return self.tensor[index].clone()


class _File:
    def __init__(self, real: Any, reads: list[tuple[str, Any]]) -> None:  # noqa: ANN401
        self.real, self.reads = real, reads

    def __enter__(self) -> _File:
        self.real.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.real.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.real.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        raise AssertionError(f"a shard read all of {key!r}")

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.real.get_tensor(key), self.reads, key)


@pytest.mark.parametrize("embedding", ["replicated", "vocab_parallel"])
def test_a_rank_reads_only_its_part_and_holds_the_whole_models_slices(
        ckpt_b: Path, monkeypatch: pytest.MonkeyPatch, embedding: str) -> None:
    # ckpt_b: 4 query heads over 2 KV heads, untied lm_head
    full, config = load_model(str(ckpt_b))
    reads: list[tuple[str, Any]] = []
    real_open = readers.safe_open
    monkeypatch.setattr(readers, "safe_open", lambda path, **kw: _File(real_open(path, **kw), reads))
    q, kv, d = config.q_size, config.kv_size, config.head_dim
    for rank in (0, 1):
        model, _ = load_model(str(ckpt_b), shard=ModelShard(rank, 2, embedding=embedding))
        assert model.config.num_attention_heads == 2 and model.config.num_key_value_heads == 1
        a, b = full.model.layers[1], model.model.layers[1]
        rows = lambda lo, n: slice(lo + rank * n, lo + (rank + 1) * n)  # noqa: E731
        want_qkv = torch.cat([a.self_attn.qkv_proj.weight[rows(0, q // 2)],
                              a.self_attn.qkv_proj.weight[rows(q, kv // 2)],
                              a.self_attn.qkv_proj.weight[rows(q + kv, kv // 2)]])
        assert torch.equal(b.self_attn.qkv_proj.weight, want_qkv)
        assert torch.equal(b.self_attn.o_proj.weight, a.self_attn.o_proj.weight[:, rows(0, q // 2)])
        i = config.intermediate_size
        assert torch.equal(b.mlp.gate_up_proj.weight, torch.cat([a.mlp.gate_up_proj.weight[rows(0, i // 2)],
                                                                 a.mlp.gate_up_proj.weight[rows(i, i // 2)]]))
        assert torch.equal(b.mlp.down_proj.weight, a.mlp.down_proj.weight[:, rows(0, i // 2)])
        assert b.self_attn.o_proj.partial_output and b.mlp.down_proj.partial_output
        assert b.self_attn.o_proj.parallel == b.mlp.down_proj.parallel == Parallel("row", rank, 2)
        assert b.self_attn.qkv_proj.parallel == b.mlp.gate_up_proj.parallel == Parallel("column", rank, 2)
        assert not b.self_attn.qkv_proj.partial_output
        v = config.vocab_size
        assert model.lm_head.parallel == Parallel("vocab", rank, 2)
        assert torch.equal(model.lm_head.weight, full.lm_head.weight[rows(0, v // 2)])
        if embedding == "vocab_parallel":
            assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
            assert torch.equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight[rows(0, v // 2)])
        else:
            assert torch.equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight)
        assert d == model.config.head_dim
    q_reads = [index for name, index in reads if name.endswith("layers.0.self_attn.q_proj.weight")]
    assert q_reads == [slice(0, q // 2), slice(q // 2, q)]  # each rank its half of the rows, nothing more
    o_reads = [index for name, index in reads if name.endswith("layers.0.self_attn.o_proj.weight")]
    assert o_reads == [(slice(None), slice(0, q // 2)), (slice(None), slice(q // 2, q))]


def test_a_tied_vocabulary_parallel_head_reads_the_replicated_embeddings_rows(ckpt_a: Path) -> None:
    full, config = load_model(str(ckpt_a))  # tied
    model, _ = load_model(str(ckpt_a), shard=ModelShard(1, 2))
    head = model.lm_head
    assert head.parallel == Parallel("vocab", 1, 2) and isinstance(head.method, TiedRows)
    assert "lm_head.weight" not in dict(model.named_parameters())  # no copy: a view of the embedding
    assert head.weight.data_ptr() == model.model.embed_tokens.weight[config.vocab_size // 2:].data_ptr()
    assert torch.equal(head.weight, full.lm_head.weight[config.vocab_size // 2:])


def test_a_ranks_dummy_weights_are_its_part_of_the_whole_dummy_model(ckpt_b: Path) -> None:
    # one generator draws whole tensors in one order: a rank keeps its part of each (FP8
    # row-parallel layers need the process group: tests/integration/test_tensor_parallel.py)
    quantization = None
    full, config = load_model(str(ckpt_b), load_format="dummy", quantization=quantization)
    real, _ = load_model(str(ckpt_b))
    assert not torch.equal(full.model.layers[0].mlp.down_proj.weight, real.model.layers[0].mlp.down_proj.weight)
    i = config.intermediate_size // 2
    for rank in (0, 1):
        part, _ = load_model(str(ckpt_b), load_format="dummy", quantization=quantization,
                             shard=ModelShard(rank, 2, lm_head="replicated"))
        a, b = full.model.layers[1].mlp, part.model.layers[1].mlp
        cols = slice(rank * i, (rank + 1) * i)
        assert torch.equal(b.down_proj.dense_weight(), a.down_proj.dense_weight()[:, cols])
        assert torch.equal(b.gate_up_proj.dense_weight()[:i], a.gate_up_proj.dense_weight()[cols])
        assert torch.equal(part.lm_head.weight, full.lm_head.weight)
        assert torch.equal(part.model.norm.weight, full.model.norm.weight)


def test_devices_per_rank() -> None:
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    assert plan_devices("cpu", 3, 8) == [torch.device("cpu")] * 3
    assert plan_devices("auto", 2, 0) == [torch.device("cpu")] * 2
    assert plan_devices("auto", 2, 2) == [cuda(0), cuda(1)]
    assert plan_devices("cuda:2", 2, 4) == [cuda(2), cuda(3)]
    with pytest.raises(ValueError, match=r"needs 2 CUDA devices .* has 1"):
        plan_devices("cuda", 2, 1)
    with pytest.raises(ValueError, match=r"cuda:3..cuda:4"):
        plan_devices("cuda:3", 2, 4)
    assert torchrun_device("auto", 1, 2) == cuda(1)
    with pytest.raises(ValueError, match="local rank 2 has no GPU"):
        torchrun_device("cuda", 2, 2)


def test_messages_round_trip_with_tensors_in_and_beside_the_pickle() -> None:
    plan = plan_batch([Row(2, 5, [7]), Row(0, 9, [8])])
    ids = torch.tensor([7, 8])
    changes = PoolChanges(0, np.array([[2, 1, 17], [3, 0, 5]]), (((40, 41), (36, 37)),))
    message = Message((changes,), Invoke(3, "run", (plan, DeviceIds((0, 1), ids))))
    data, wire = encode(message, frozenset())
    assert wire == []  # CPU tensors travel inside the pickle
    got, slots = decode(data, torch.device("cpu"))
    assert slots == [] and len(got.changes) == 1
    assert np.array_equal(got.changes[0].tables, changes.tables) and got.changes[0].moves == changes.moves
    assert (got.call.target, got.call.method) == (3, "run")
    sent = got.call.args[0]
    assert sent.arrays.keys() == plan.arrays.keys()
    assert all(np.array_equal(sent.arrays[k], plan.arrays[k]) for k in plan.arrays)
    assert got.call.args[1].at == (0, 1) and torch.equal(got.call.args[1].ids, ids)
    # tensors on the rank's device go beside the pickle: the receiver gets empty ones to fill
    data, wire = encode(Message((), Invoke(1, "run", (plan, DeviceIds((0, 1), ids)))), frozenset({"cpu"}))
    assert len(wire) == 1 and torch.equal(wire[0], ids)
    got, slots = decode(data, torch.device("cpu"))
    assert len(slots) == 1 and slots[0].shape == ids.shape and slots[0].dtype == ids.dtype
    assert got.call.args[1].ids is slots[0]


def test_a_worker_is_invoked_only_for_the_forward() -> None:
    for method in ("sample", "verify_tree", "__call__"):
        with pytest.raises(ValueError, match=rf"runs one of \('run',\), not '{method}'"):
            Invoke(0, method, ())


def test_collective_kernels_are_told_apart() -> None:
    assert collective_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "all_reduce"
    assert collective_kind("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert collective_kind("ncclDevKernel_Broadcast_RING_LL") == "broadcast"
    assert collective_kind("ncclDevKernel_SendRecv") == "other_collective"
    assert collective_kind("ampere_bf16_s16816gemm") is None
    assert collective_kind("void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)") \
        == "all_reduce"
    out = summarize_kernels([("ncclDevKernel_AllReduce_Sum", 30.0), ("gemm", 150.0),
                             ("ncclDevKernel_AllReduce_Sum", 30.0), ("ncclDevKernel_AllGather", 20.0)],
                            steps=2, wall_s=0.0004)
    assert out["all_reduce_ms_per_step"] == pytest.approx(0.03) and out["all_reduce_calls_per_step"] == 1
    assert out["all_reduce_share_of_step"] == pytest.approx(0.15)
    assert out["collectives_share_of_gpu_time"] == pytest.approx(80 / 230)


def test_engine_config_validates_the_tensor_parallel_fields() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_lm_head must be one of"):
        EngineConfig(tensor_parallel_lm_head="columns")
    with pytest.raises(ValueError, match="tensor_parallel_draft='sharded' applies to a draft model"):
        EngineConfig(tensor_parallel_draft="sharded", speculative_method="ngram")
    with pytest.raises(ValueError, match="tensor_parallel_draft configures speculative decoding"):
        EngineConfig(tensor_parallel_draft="sharded", use_speculative_decoding=False)
    EngineConfig(tensor_parallel_size=2, use_speculative_decoding=True, tensor_parallel_draft="sharded")


@pytest.mark.parametrize("quantization", [None, "fp8", "int4"])
def test_a_ranks_model_is_a_llama_of_its_shape_built_parallel(quantization: str | None) -> None:
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = _meta_model(config, ModelShard(1, 2, lm_head="replicated"), quantization)
    whole = _meta_model(config, None, quantization)
    assert model.config == ModelShard(1, 2).model_config(config)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attn.heads, attn.kv_heads, attn.qkv_proj.out_features, attn.o_proj.in_features) == (2, 1, 32, 16)
    assert mlp.gate_up_proj.out_features == 64 and mlp.down_proj.in_features == 32
    # each projection built with its setting and the whole model's quantization method
    for layer, kind in ((attn.qkv_proj, "column"), (mlp.gate_up_proj, "column"), (attn.o_proj, "row"),
                        (mlp.down_proj, "row")):
        assert layer.parallel == Parallel(kind, 1, 2)
        assert layer.quantization == whole.model.layers[0].self_attn.qkv_proj.quantization
    assert model.lm_head.out_features == 64 and not model.lm_head.partial_output


def test_a_gguf_file_shards_like_a_checkpoint(ckpt_b: Path, tmp_path: Path) -> None:
    # GGUF tensors arrive whole (dequantized): each rank keeps its part of each
    from helpers.gguf_files import write_gguf
    path = write_gguf(ckpt_b, tmp_path / "b.gguf")
    full, config = load_model(str(path))
    parts = [load_model(str(path), shard=ModelShard(rank, 2))[0] for rank in (0, 1)]
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        whole = dict(full.named_parameters())[name]
        assert torch.equal(torch.cat([dict(p.named_parameters())[name] for p in parts], dim=1), whole)
    up = [p.model.layers[0].mlp.gate_up_proj.weight for p in parts]
    i = config.intermediate_size
    assert torch.equal(torch.cat([u[:i // 2] for u in up]), full.model.layers[0].mlp.gate_up_proj.weight[:i])


@pytest.mark.parametrize("entry", ["cli", "server"])
def test_torchrun_ranks_above_0_become_workers_of_either_entry_point(monkeypatch: pytest.MonkeyPatch,
                                                                    entry: str) -> None:
    # under torchrun every rank runs the same command line: `infer serve|generate` or
    # `python -m infer.server`; ranks above 0 serve rank 0's engine instead of the command
    import infer.distributed.worker as worker
    from infer.cli import main as cli_main
    from infer.server.__main__ import main as server_main

    seen: list[EngineConfig] = []
    monkeypatch.setattr(worker, "serve_torchrun_rank", lambda config: seen.append(config) or 0)
    argv = ["--tensor-parallel-size", "2", "--device", "cpu"]
    run = (lambda: cli_main(["serve", *argv])) if entry == "cli" else (lambda: server_main(argv))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run() == 0 and [c.tensor_parallel_size for c in seen] == [2]
    if entry == "cli":  # a command torchrun cannot split: a clear error
        assert cli_main(["bench", "--suite", "smoke"]) == 2
    monkeypatch.setenv("RANK", "0")  # rank 0 runs the command itself
    monkeypatch.setattr("infer.server.__main__.serve", lambda args: 7)
    monkeypatch.setattr("infer.cli._cmd_serve", lambda args: 7)
    assert run() == 7 and len(seen) == 1
