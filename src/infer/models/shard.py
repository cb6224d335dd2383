"""ModelShard: how the loader builds and fills one tensor-parallel rank's part of a model.

`infer.distributed.sharding.TensorParallelShard` implements it. With a shard the loader
(models/loader.py) builds `shard.build(config, quantization)` instead of the whole model and
reads of each checkpoint tensor only the part `shard.part(name, shape)` names: through
safetensors' `get_slice`, so the rest of the tensor is never read or materialised; tensors
that arrive whole (GGUF files dequantize whole tensors) are narrowed to that part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from infer.models.config import ModelConfig

if TYPE_CHECKING:
    from infer.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class TensorPart:
    """Indices start..stop-1 along dimension `dim` (0: rows, 1: columns) of a checkpoint tensor."""

    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or not 0 <= self.start < self.stop:
            raise ValueError(f"a tensor part is a non-empty range of rows or columns, got {self}")


class ModelShard(Protocol):
    def check(self, config: ModelConfig) -> None:
        """Raise ValueError, naming the sizes, when the model cannot be split this way."""
        ...

    def build(self, config: ModelConfig, quantization: str | None) -> LlamaForCausalLM:
        """This rank's model for the whole model's `config` (called on the meta device)."""
        ...

    def part(self, name: str, shape: tuple[int, ...]) -> TensorPart | None:
        """The part of checkpoint tensor `name` (Hugging Face name, whole shape) this rank
        holds; None: all of it."""
        ...


class TensorSlice(Protocol):
    """What safetensors' `get_slice` returns: the tensor's shape, and indexing that reads
    only the rows (`[a:b]`) or columns (`[:, a:b]`) asked for."""

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


def shard_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                  shard: ModelShard) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) of whole named tensors, one at a time."""
    for name, tensor in tensors:
        yield name, narrow_part(tensor, shard.part(name, tuple(tensor.shape)))
