"""Integer storage beyond the projections: `QuantizedEmbedding` (a `LinearBase` [vocab, hidden]
of codes whose lookup dequantizes the rows it reads) and `SharedWeights` (the method of an
lm_head tied to it)."""

from __future__ import annotations

import torch

from infer.models.layers.int_quant import IntLayout
from infer.models.layers.linear import IntWeights, LinearBase


class QuantizedEmbedding(LinearBase):
    """Token embedding [num_embeddings, embedding_dim] stored as integer codes."""

    def __init__(self, num_embeddings: int, embedding_dim: int, layout: IntLayout) -> None:
        self.int_method = IntWeights(layout)
        super().__init__(embedding_dim, num_embeddings, self.int_method)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> embeddings [..., embedding_dim] in the model's dtype."""
        return self.int_method.rows(self, ids)


class SharedWeights:
    """W is `owner`'s matrix (a head tied to a quantized embedding); no parameter of its own."""

    checkpoint_params: tuple[str, ...] = ()
    fixed_dtype_params: tuple[str, ...] = ()

    def __init__(self, owner: LinearBase) -> None:
        self._owner: tuple[LinearBase] = (owner,)  # in a tuple: registered under the model body only

    @property
    def name(self) -> str | None:
        return self._owner[0].quantization

    def create_weights(self, layer: LinearBase) -> None:
        pass

    def load_weight(self, layer: LinearBase, tensor: object, row_offset: int | None, name: str) -> None:
        raise ValueError(f"tensor {name!r}: this head is tied to the embedding and has no weights of its own")

    def load_scale(self, layer: LinearBase, scale: torch.Tensor, row_offset: int | None, rows: int,
                   name: str) -> None:
        self.load_weight(layer, scale, row_offset, name)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        owner = self._owner[0]
        return owner.method.apply(owner, x)

    def matrix(self, layer: LinearBase) -> tuple[torch.Tensor, object]:
        return self._owner[0].matrix()

    def dense_weight(self, layer: LinearBase, dtype: torch.dtype | None) -> torch.Tensor:
        return self._owner[0].dense_weight(dtype)
