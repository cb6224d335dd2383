"""Tensor-parallel pieces that are not a plain `LinearBase` with a `Parallel` setting.

The Megatron split of a Llama decoder's matrices is the layers' `parallel` attribute
(models/parallel.py): column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj
(one all-reduce), a vocabulary-parallel lm_head (one all-gather). Two pieces remain here:

- `VocabParallelEmbedding`: a rank holds V / N rows; ids outside them look up zeros and one
  all-reduce sums the ranks' lookups.
- `TiedRows`: the quantization method of a vocabulary-parallel lm_head tied to a replicated
  embedding: its W is rows start..stop-1 of the embedding's matrix (a view, no copy), so
  the layer owns no parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.linear import LinearBase
from infer.models.parallel import all_reduce_sum


class TiedRows:
    """W = rows start..stop-1 of `embedding`'s weight [stop - start, H]."""

    name = None
    checkpoint_params: tuple[str, ...] = ()
    fixed_dtype_params: tuple[str, ...] = ()

    def __init__(self, embedding: nn.Embedding, start: int, stop: int) -> None:
        # held in a tuple: the embedding stays registered under the model body only
        self._embedding: tuple[nn.Embedding] = (embedding,)
        self.start, self.stop = start, stop

    def rows(self) -> torch.Tensor:
        return self._embedding[0].weight[self.start:self.stop]

    def create_weights(self, layer: LinearBase) -> None:
        pass

    def load_weight(self, layer: LinearBase, tensor: torch.Tensor, row_offset: int | None, name: str) -> None:
        raise ValueError(f"tensor {name!r}: a tied lm_head has no weights of its own (it reads the embedding's)")

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        self.load_weight(layer, scale, row_offset, name)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.rows())

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.rows(), None

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return self.rows() if dtype is None else self.rows().to(dtype)


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
