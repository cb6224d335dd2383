"""Tensor-parallel layers: the Megatron split of a Llama decoder's matrices over N ranks.

- Column-parallel (q/k/v, gate/up): a rank holds a block of output rows (its heads, its
  part of the intermediate size), so its output needs no communication. These stay plain
  `DenseLinear` / `Fp8Linear` layers of the shard's shape; sharding.py reads their rows.
- Row-parallel (o_proj, down_proj): a rank holds a block of input columns; its matmul is a
  partial sum, completed by one all-reduce in `combine` (before the residual add: the fused
  kernels see `partial_output` and keep the add out of the matmul's epilogue).
- Vocabulary-parallel lm_head: a rank holds V / N rows of the head; `combine` all-gathers
  the logits so every rank has all of them (each rank samples the same draft tokens).
- Vocabulary-parallel embedding: a rank holds V / N rows; ids outside them look up zeros
  and one all-reduce sums the ranks' lookups.

Collectives run on torch.distributed's default process group (the engine's tensor-parallel
group: NCCL on GPUs, where CUDA graphs capture them like any kernel; gloo on CPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from infer.models.linear import DenseLinear, Fp8Linear, LinearBase
from infer.models.linear_tiles import SplitWorkspace

# torch 2.13 renamed all_gather_into_tensor (deprecated since) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_sum(y: torch.Tensor) -> torch.Tensor:
    """Sum y over the ranks, in place (every rank gets the same bits); returns y."""
    dist.all_reduce(y)
    return y


def all_gather_columns(y: torch.Tensor, world_size: int) -> torch.Tensor:
    """[..., n] on each rank -> [..., world_size * n]: rank r's columns at r*n..(r+1)*n-1."""
    rows = y.reshape(-1, y.shape[-1]).contiguous()  # [M, n]
    m, n = rows.shape
    out = torch.empty((world_size * m, n), dtype=y.dtype, device=y.device)
    _all_gather_single(out, rows)  # [N * M, n]: rank r's rows at r*M..
    return out.view(world_size, m, n).permute(1, 0, 2).reshape(*y.shape[:-1], world_size * n)


class RowParallelDense(DenseLinear):
    """y = x_r W_r^T summed over ranks: W_r [out, in / N], the rank's input columns."""

    partial_output = True

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(y)


class RowParallelFp8(Fp8Linear):
    """The FP8 row-parallel layer. A row's scale comes from its max |w| over every rank's
    columns (one all-reduce at load), so each rank's columns quantize exactly as the whole
    matrix's would on one GPU."""

    partial_output = True

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(y)

    def row_absmax(self, rows: torch.Tensor) -> torch.Tensor:
        peak = rows.abs().amax(dim=1)  # [n]
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak


def row_parallel(in_features: int, out_features: int, quantization: str | None) -> LinearBase:
    """A row-parallel layer with the rank's `in_features` (the whole input / N) columns."""
    if quantization == "fp8":
        return RowParallelFp8(in_features, out_features)
    return RowParallelDense(in_features, out_features)


class VocabParallelHead(DenseLinear):
    """lm_head with the rank's V / N rows [V / N, H]; the logits are all-gathered."""

    def __init__(self, hidden_size: int, vocab_rows: int, world_size: int) -> None:
        super().__init__(hidden_size, vocab_rows)
        self.world_size = world_size

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return all_gather_columns(y, self.world_size)


class TiedVocabParallelHead(LinearBase):
    """A vocabulary-parallel lm_head tied to a replicated embedding: its weight is rows
    start..stop-1 of the embedding's matrix (a view, no copy), so it owns no parameter."""

    def __init__(self, embedding: nn.Embedding, start: int, stop: int, world_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features = embedding.embedding_dim, stop - start
        self.start, self.stop, self.world_size = start, stop, world_size
        # held in a tuple: the embedding stays registered under the model body only
        self._embedding: tuple[nn.Embedding] = (embedding,)
        self.workspace = SplitWorkspace()

    def weight_rows(self) -> torch.Tensor:
        """[V / N, H]: the embedding rows of this rank's vocabulary."""
        return self._embedding[0].weight[self.start:self.stop]

    @property
    def weight(self) -> torch.Tensor:
        """(read-only: `weight_rows`, as `lm_head.weight` reads on other heads)"""
        return self.weight_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(F.linear(x, self.weight_rows()))

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        return all_gather_columns(y, self.world_size)

    def load_rows(self, tensor: torch.Tensor, row_offset: int | None, name: str = "weight") -> None:
        raise ValueError(f"tensor {name!r}: a tied lm_head has no weights of its own (it reads the embedding's)")

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight_rows(), None

    def dense_weight(self) -> torch.Tensor:
        return self.weight_rows()


class VocabParallelEmbedding(nn.Embedding):
    """The rank's embedding rows start..start + rows - 1 [rows, H]; a lookup of an id outside
    them gives zeros, and the all-reduce sums the ranks' lookups (one rank holds each id)."""

    def __init__(self, rows: int, embedding_dim: int, start: int) -> None:
        super().__init__(rows, embedding_dim)
        self.start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [B, T]
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, T, H]
        return all_reduce_sum(out.masked_fill(outside[..., None], 0))
