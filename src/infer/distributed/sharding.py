"""Which part of a Llama checkpoint each tensor-parallel rank holds, and its model.

`TensorParallelShard(rank, world_size, embedding, lm_head)` is a `ModelShard`
(models/shard.py): the loader builds `ShardedLlamaForCausalLM` (the decoder with a rank's
heads and intermediate size; its linear layers' `parallel` settings say which part each
holds: column-parallel q/k/v and gate/up, row-parallel o_proj / down_proj, a replicated or
vocabulary-parallel lm_head) and reads of each Hugging Face tensor only the rank's part:

    q/k/v_proj, gate/up_proj   rows      (heads, intermediate: column-parallel; q/k/v biases too)
    o_proj, down_proj          columns   (row-parallel; per-row FP8 scales whole)
    embed_tokens, lm_head      rows when "vocab_parallel", else whole
    norms                      whole

Heads split in contiguous blocks: rank r holds query heads r*Hq/N.. and KV heads
r*Hkv/N.., which keeps each query head with its KV head (Hq/N is a multiple of the group
size Hq/Hkv). Sizes that do not divide by N are a ValueError naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from infer.distributed.layers import TiedRows, VocabParallelEmbedding
from infer.models.config import ModelConfig
from infer.models.linear import LinearBase, make_linear
from infer.models.llama import LlamaForCausalLM
from infer.models.parallel import Parallel
from infer.models.shard import TensorPart

VOCAB_LAYOUTS = ("replicated", "vocab_parallel")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TensorParallelShard:
    rank: int
    world_size: int
    embedding: str = "replicated"  # "replicated" | "vocab_parallel"
    lm_head: str = "vocab_parallel"  # "replicated" | "vocab_parallel"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        for name in ("embedding", "lm_head"):
            if getattr(self, name) not in VOCAB_LAYOUTS:
                raise ValueError(f"{name} must be one of {list(VOCAB_LAYOUTS)}, got {getattr(self, name)!r}")

    def check(self, config: ModelConfig) -> None:
        n = self.world_size
        sizes = {"num_attention_heads": config.num_attention_heads,
                 "num_key_value_heads": config.num_key_value_heads,
                 "intermediate_size": config.intermediate_size}
        if self.embedding == "vocab_parallel" or self.lm_head == "vocab_parallel":
            sizes["vocab_size"] = config.vocab_size
        bad = [f"{name} ({value})" for name, value in sizes.items() if value % n]
        if bad:
            hint = (" (or keep the vocabulary whole: tensor_parallel_embedding / tensor_parallel_lm_head "
                    "'replicated')" if any(b.startswith("vocab_size") for b in bad) else "")
            raise ValueError(f"tensor_parallel_size={n} cannot split this model: {', '.join(bad)} "
                             f"{'is' if len(bad) == 1 else 'are'} not divisible by {n}; choose a size "
                             f"that divides them{hint}")
        if config.tie_word_embeddings and self.embedding == "vocab_parallel" and self.lm_head == "replicated":
            raise ValueError("this model ties lm_head to the embedding: with tensor_parallel_embedding="
                             "'vocab_parallel' the lm_head must be 'vocab_parallel' too")

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """The decoder shape of one rank: heads and intermediate size / N (vocab whole)."""
        n = self.world_size
        return replace(config, num_attention_heads=config.num_attention_heads // n,
                       num_key_value_heads=config.num_key_value_heads // n,
                       intermediate_size=config.intermediate_size // n)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(start, stop): the vocabulary rows of this rank when the vocabulary is split."""
        size = vocab_size // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def build(self, config: ModelConfig, quantization: str | None) -> LlamaForCausalLM:
        return ShardedLlamaForCausalLM(config, quantization, self)

    def part(self, name: str, shape: tuple[int, ...]) -> TensorPart | None:
        pieces = name.split(".")
        leaf, module = pieces[-1], pieces[-2] if len(pieces) >= 2 else ""
        if module in _COLUMN and leaf in ("weight", "bias"):
            return self._split(name, shape, 0)
        if module in _COLUMN and leaf == "weight_scale":
            per_row = len(shape) >= 1 and shape[0] > 1  # else one scale for the whole tensor
            return self._split(name, shape, 0) if per_row else None
        if module in _ROW and leaf == "weight":
            return self._split(name, shape, 1)
        if (name == "model.embed_tokens.weight" and self.embedding == "vocab_parallel") or (
                name == "lm_head.weight" and self.lm_head == "vocab_parallel"):
            return self._split(name, shape, 0)
        return None

    def _split(self, name: str, shape: tuple[int, ...], dim: int) -> TensorPart:
        if len(shape) <= dim or shape[dim] % self.world_size:
            raise ValueError(f"tensor {name!r} of shape {shape} cannot be split in {self.world_size} along "
                             f"dimension {dim}")
        size = shape[dim] // self.world_size
        return TensorPart(dim, self.rank * size, (self.rank + 1) * size)


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """One rank's model: `config` is this rank's decoder shape (`model_config`), the linear
    layers hold their parts (`parallel`), and the embedding and lm_head are replicated or
    vocabulary-parallel as the shard says."""

    head_reads_embedding = False  # (set before the base class ties lm_head in its __init__)

    def __init__(self, full: ModelConfig, quantization: str | None, shard: TensorParallelShard) -> None:
        super().__init__(shard.model_config(full), quantization)
        self.shard = shard
        rank, n = shard.rank, shard.world_size
        column, row = Parallel("column", rank, n), Parallel("row", rank, n)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = _resharded(attn.qkv_proj, column, quantization)
            mlp.gate_up_proj = _resharded(mlp.gate_up_proj, column, quantization)
            attn.o_proj = _resharded(attn.o_proj, row, quantization)
            mlp.down_proj = _resharded(mlp.down_proj, row, quantization)
        hidden = full.hidden_size
        start, stop = shard.vocab_rows(full.vocab_size)
        if shard.embedding == "vocab_parallel":
            self.model.embed_tokens = VocabParallelEmbedding(stop - start, hidden, start)
        # a vocabulary-parallel head tied to a replicated embedding reads the embedding's rows
        self.head_reads_embedding = (shard.lm_head == "vocab_parallel" and full.tie_word_embeddings
                                     and shard.embedding == "replicated")
        if self.head_reads_embedding:
            self.lm_head = LinearBase(hidden, stop - start, TiedRows(self.model.embed_tokens, start, stop),
                                      Parallel("vocab", rank, n))
        elif shard.lm_head == "vocab_parallel":
            self.lm_head = make_linear(hidden, stop - start, None, Parallel("vocab", rank, n))
        self.tie_weights()

    def tie_weights(self) -> None:
        # a head that reads the embedding's rows holds the embedding module itself (which
        # `to_empty` keeps), not a parameter to re-tie
        if not self.head_reads_embedding:
            super().tie_weights()


def _resharded(layer: LinearBase, parallel: Parallel, quantization: str | None) -> LinearBase:
    """A layer of the same local shape and bias that holds its part as `parallel` says."""
    return make_linear(layer.in_features, layer.out_features, quantization, parallel, bias=layer.bias is not None)
