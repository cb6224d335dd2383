"""The per-layer integer layouts a load stores (fused module name -> `IntLayout`).

`apply_layouts(model, layouts)` gives the named layers (`model.layers.3.self_attn.qkv_proj`,
`lm_head`, `model.embed_tokens`) integer storage, on the meta model before it is materialised.
"""

from __future__ import annotations

from collections.abc import Callable

from infer.models.config import ModelConfig
from infer.models.layers.int_embedding import QuantizedEmbedding, SharedWeights
from infer.models.layers.int_quant import IntLayout, default_group
from infer.models.layers.linear import INT_QUANTIZATIONS, IntWeights, LinearBase
from infer.models.llama import LlamaForCausalLM

EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
HEAD_BITS = 8  # a model quantized at load keeps its head (and a tied embedding) in 8 bits

LayerLayouts = dict[str, IntLayout]  # fused module name -> its integer layout


def projection_layouts(config: ModelConfig, layout_for: Callable[[int], IntLayout]) -> LayerLayouts:
    """Every decoder projection (fused names), each in the layout `layout_for(in_features)`."""
    layouts = {}
    for i in range(config.num_hidden_layers):
        for name, k in (("self_attn.qkv_proj", config.hidden_size), ("self_attn.o_proj", config.q_size),
                        ("mlp.gate_up_proj", config.hidden_size), ("mlp.down_proj", config.intermediate_size)):
            layouts[f"model.layers.{i}.{name}"] = layout_for(k)
    return layouts


def head_layouts(config: ModelConfig, quantization: str | None) -> LayerLayouts:
    """The head's layout (HEAD_BITS codes; a tied embedding's) for "int4" / "int8", else none."""
    if quantization not in INT_QUANTIZATIONS:
        return {}
    layout = IntLayout(HEAD_BITS, default_group(config.hidden_size))
    return {EMBEDDING if config.tie_word_embeddings else HEAD: layout}


def apply_layouts(model: LlamaForCausalLM, layouts: LayerLayouts) -> None:
    """Store the named layers as their layouts say (on the meta device: new parameters are
    uninitialised). A quantized embedding of a tied model carries the head."""
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
