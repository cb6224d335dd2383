"""How a layer's matrix is split over tensor-parallel ranks and how its output is completed.

`Parallel` kinds: `replicated`, `column` (output rows: q/k/v, gate/up), `row` (input columns: o, down; partial sums
all-reduced) or `vocab` (vocabulary rows: logits all-gathered, embedding lookups summed). `Parallel.part(name,
shape)` is the block of a checkpoint tensor the loader reads; `Collectives` completes outputs over the default
process group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

PARALLEL_KINDS = ("replicated", "column", "row", "vocab")

# torch 2.13 renamed all_gather_into_tensor (deprecated since) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class TensorPart:
    """Indices start..stop-1 along dimension `dim` (0: rows, 1: columns) of a checkpoint tensor."""

    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or not 0 <= self.start < self.stop:
            raise ValueError(f"a tensor part is a non-empty range of rows or columns, got {self}")


# y -> the sum over the ranks (a new tensor), or None for a message it does not serve
SmallAllReduce = Callable[[torch.Tensor], torch.Tensor | None]


class Collectives:
    """A parallel layer's collectives over the default process group; `small`, when given, is
    tried first for each all-reduce (`close` drops it)."""

    def __init__(self, small: SmallAllReduce | None = None) -> None:
        self.small = small

    def close(self) -> None:
        self.small = None

    def all_reduce_sum(self, y: torch.Tensor) -> torch.Tensor:
        """Sum y over the ranks (same bits on every rank): y in place, or a new tensor from `small`."""
        if self.small is not None:
            out = self.small(y)
            if out is not None:
                return out
        dist.all_reduce(y)
        return y

    @staticmethod
    def all_reduce_max(y: torch.Tensor) -> torch.Tensor:
        """Elementwise max of y over the ranks, in place; returns y."""
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        return y

    @staticmethod
    def all_gather_columns(y: torch.Tensor, world_size: int) -> torch.Tensor:
        """[..., n] on each rank -> [..., world_size * n]: rank r's columns at r*n..(r+1)*n-1."""
        rows = y.reshape(-1, y.shape[-1]).contiguous()  # [M, n]
        m, n = rows.shape
        out = torch.empty((world_size * m, n), dtype=y.dtype, device=y.device)
        _all_gather_single(out, rows)  # [N * M, n]: rank r's rows at r*M..
        return out.view(world_size, m, n).permute(1, 0, 2).reshape(*y.shape[:-1], world_size * n)


GROUP = Collectives()  # the default group's own collectives (nothing tried first)


@dataclass(frozen=True, slots=True)
class Parallel:
    """Which part of the whole matrix a layer holds: `kind` over `world_size` ranks, at `rank`."""

    kind: str = "replicated"
    rank: int = 0
    world_size: int = 1
    collectives: Collectives = field(default=GROUP, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in PARALLEL_KINDS:
            raise ValueError(f"parallel kind must be one of {list(PARALLEL_KINDS)}, got {self.kind!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        if self.kind == "replicated" and self.world_size != 1:
            raise ValueError("a replicated layer is described with world_size 1 (each rank holds all of it)")

    def span(self, size: int) -> tuple[int, int]:
        """(start, stop): this rank's block of `size` rows (column, vocab) or columns (row)."""
        if self.kind == "replicated":
            return 0, size
        block = size // self.world_size
        return self.rank * block, (self.rank + 1) * block

    def part(self, name: str, shape: tuple[int, ...]) -> TensorPart | None:
        """The part of checkpoint tensor `name` (whole `shape`) this layer holds (None: all): column
        and vocab layers' rows, a row-parallel layer's weight columns."""
        leaf = name.rpartition(".")[2]
        per_row = leaf == "weight_scale" and len(shape) >= 1 and shape[0] > 1  # else one scale for the tensor
        dim = {"column": 0 if leaf in ("weight", "bias") or per_row else None,
               "row": 1 if leaf == "weight" else None,
               "vocab": 0 if leaf == "weight" else None}.get(self.kind)
        if dim is None:
            return None
        if len(shape) <= dim or shape[dim] % self.world_size:
            raise ValueError(f"tensor {name!r} of shape {shape} cannot be split in {self.world_size} along "
                             f"dimension {dim}")
        return TensorPart(dim, *self.span(shape[dim]))

    @property
    def partial_output(self) -> bool:
        """Whether the local matmul is a partial sum (row-parallel): a residual add comes after `combine`."""
        return self.kind == "row"

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from its local matmul's y [..., local out]."""
        if self.kind == "row":
            return self.collectives.all_reduce_sum(y)
        if self.kind == "vocab":
            return self.collectives.all_gather_columns(y, self.world_size)
        return y


REPLICATED = Parallel()


class VocabParallelEmbedding(nn.Embedding):
    """A rank's block of the embedding's rows [V / N, H]; ids outside it look up zeros, and the
    all-reduce sums the ranks' lookups. Extra keywords go to nn.Embedding."""

    def __init__(self, parallel: Parallel, vocab_size: int, embedding_dim: int, **kwargs: object) -> None:
        if parallel.kind != "vocab":
            raise ValueError(f"a vocabulary-parallel embedding splits the vocabulary, not {parallel.kind!r}")
        start, stop = parallel.span(vocab_size)
        super().__init__(stop - start, embedding_dim, **kwargs)  # type: ignore[arg-type]
        self.parallel, self.start = parallel, start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [B, T]
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, T, H]
        return self.parallel.collectives.all_reduce_sum(out.masked_fill(outside[..., None], 0))
