"""Integer storage beyond the decoder's projections: the embedding and the head, and the
per-layer layouts a checkpoint stores.

- `QuantizedEmbedding`: the token embedding as a `LinearBase` [vocab, hidden] of integer
  codes; a lookup dequantizes the rows it reads. It loads from the checkpoint's
  `model.embed_tokens.weight` like any linear layer's weight.
- `SharedWeights`: the quantization method of an lm_head tied to such an embedding: W is
  the embedding's matrix, read through the embedding's own method (no parameter of its own).
- `apply_layouts(model, layouts)`: gives the named layers (fused names:
  `model.layers.3.self_attn.qkv_proj`, `lm_head`, `model.embed_tokens`) integer storage in
  the given layouts, on the meta model before it is materialised. The loader's plan says
  which: a GPTQ / AWQ / compressed-tensors checkpoint's layers, a GGUF file's quantized
  tensors, the head of a model quantized at load (`head_layouts`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.models.config import ModelConfig
from infer.models.int_quant import IntLayout, default_group
from infer.models.linear import INT_QUANTIZATIONS, IntWeights, LinearBase
from infer.models.llama import LlamaForCausalLM

EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
HEAD_BITS = 8  # a model quantized at load keeps its head (and a tied embedding) in 8 bits

LayerLayouts = dict[str, IntLayout]  # fused module name -> its integer layout


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


def projection_layouts(config: ModelConfig, layout_for: Callable[[int], IntLayout]) -> LayerLayouts:
    """Every decoder projection (fused names), each in the layout `layout_for(in_features)`."""
    layouts = {}
    for i in range(config.num_hidden_layers):
        for name, k in (("self_attn.qkv_proj", config.hidden_size), ("self_attn.o_proj", config.q_size),
                        ("mlp.gate_up_proj", config.hidden_size), ("mlp.down_proj", config.intermediate_size)):
            layouts[f"model.layers.{i}.{name}"] = layout_for(k)
    return layouts


def head_layouts(config: ModelConfig, quantization: str | None) -> LayerLayouts:
    """The head's layout for a model quantized at load ("int4" / "int8"): HEAD_BITS codes in
    groups of up to 128 (a tied embedding shares them); none for other settings."""
    if quantization not in INT_QUANTIZATIONS:
        return {}
    layout = IntLayout(HEAD_BITS, default_group(config.hidden_size))
    return {EMBEDDING if config.tie_word_embeddings else HEAD: layout}


def apply_layouts(model: LlamaForCausalLM, layouts: LayerLayouts) -> None:
    """Store the named layers as their layouts say (call on the meta device: the new
    parameters are uninitialised). A quantized embedding of a tied model carries the head."""
    config = model.config
    linears = model.linears()
    for name, layout in layouts.items():
        if name == EMBEDDING:
            embedding = QuantizedEmbedding(config.vocab_size, config.hidden_size, layout)
            model.model.embed_tokens = embedding
            if config.tie_word_embeddings:
                model.lm_head = LinearBase(config.hidden_size, config.vocab_size, SharedWeights(embedding))
        elif name == HEAD and config.tie_word_embeddings:
            raise ValueError("a tied lm_head is stored as its embedding is: give the layout of "
                             f"{EMBEDDING!r} instead")
        elif name in linears:
            linears[name].set_method(IntWeights(layout))
        else:
            raise ValueError(f"the model has no linear layer {name!r} to store as {layout.name}")
