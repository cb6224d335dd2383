"""ModelShard: one tensor-parallel rank's part of a model, and reading it from a checkpoint.

`ModelShard(rank, world_size, embedding, lm_head)` splits a Llama decoder Megatron-style: the
rank's model has heads, KV heads and intermediate size / N (`model_config`), in contiguous head
blocks. The loader reads only each tensor's part: `read_part` (safetensors slices) or `shard_tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from infer.models.config import ModelConfig
from infer.models.layers.parallel import GROUP, REPLICATED, Collectives, Parallel, TensorPart

VOCAB_LAYOUTS = ("replicated", "vocab_parallel")

PartFn = Callable[[str, tuple[int, ...]], TensorPart | None]
"""part(checkpoint tensor name, its whole shape) -> the part a rank's model holds (None: all)."""


@dataclass(frozen=True, slots=True)
class ModelShard:
    rank: int
    world_size: int
    embedding: str = "replicated"  # "replicated" | "vocab_parallel"
    lm_head: str = "vocab_parallel"  # "replicated" | "vocab_parallel"
    collectives: Collectives = field(default=GROUP, compare=False, repr=False)  # the rank's group's

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"a model shard is one of >= 2 ranks (one rank holds the whole model), got "
                             f"world_size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        for name in ("embedding", "lm_head"):
            if getattr(self, name) not in VOCAB_LAYOUTS:
                raise ValueError(f"{name} must be one of {list(VOCAB_LAYOUTS)}, got {getattr(self, name)!r}")

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError, naming the sizes, when the model cannot be split this way."""
        n = self.world_size
        sizes = {"num_attention_heads": config.num_attention_heads,
                 "num_key_value_heads": config.num_key_value_heads,
                 "intermediate_size": config.intermediate_size}
        if "vocab_parallel" in (self.embedding, self.lm_head):
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
        """One rank's decoder shape of `config` (checked first): heads and intermediate size / N."""
        self.check(config)
        n = self.world_size
        return replace(config, num_attention_heads=config.num_attention_heads // n,
                       num_key_value_heads=config.num_key_value_heads // n,
                       intermediate_size=config.intermediate_size // n)

    @property
    def column(self) -> Parallel:
        return Parallel("column", self.rank, self.world_size, self.collectives)

    @property
    def row(self) -> Parallel:
        return Parallel("row", self.rank, self.world_size, self.collectives)

    def vocab(self, layout: str) -> Parallel:
        """The setting of a layer whose vocabulary is laid out as `layout` (the embedding's or lm_head's)."""
        return Parallel("vocab", self.rank, self.world_size, self.collectives) if layout == "vocab_parallel" \
            else REPLICATED


class TensorSlice(Protocol):
    """What safetensors' `get_slice` returns: a shape, and indexing that reads only the part asked for."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


def read_part(source: TensorSlice, part: TensorPart | None) -> torch.Tensor:
    """The part of a lazily read checkpoint tensor (None: all of it)."""
    if part is None:
        return source[:]
    if part.dim == 0:
        return source[part.start:part.stop]
    return source[:, part.start:part.stop]


def narrow_part(tensor: torch.Tensor, part: TensorPart | None) -> torch.Tensor:
    """The part of a tensor already in memory, as a tensor of its own (None: the tensor)."""
    if part is None:
        return tensor
    return tensor.narrow(part.dim, part.start, part.stop - part.start).contiguous()


def shard_tensors(tensors: Iterable[tuple[str, torch.Tensor]], parts: PartFn) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) of whole named tensors, one at a time."""
    for name, tensor in tensors:
        yield name, narrow_part(tensor, parts(name, tuple(tensor.shape)))
