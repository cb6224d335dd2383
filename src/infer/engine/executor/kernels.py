"""The kernels a runner's fixed-shape steps use: fused (torch.compile) or eager."""

from __future__ import annotations

import torch

from infer.engine.config import EngineConfig
from infer.models.eagle import EagleHead
from infer.models.kernels import EAGER, Kernels, compiled_kernels
from infer.models.llama import LlamaForCausalLM


def step_kernels(config: EngineConfig, device: torch.device,
                 model: LlamaForCausalLM | EagleHead | None = None) -> Kernels:
    """Fused (torch.compile) kernels for decode-type steps of `model` (the target, a draft
    model or an EAGLE head's rounds) when asked for; by default with CUDA graphs on a GPU.
    Prefill always uses the eager kernels. One compiled bundle per model class and shape
    (`compiled_kernels`): a head's apart from its target's of the same widths."""
    wanted = config.compile_kernels
    if wanted is None:
        wanted = config.use_cuda_graphs and device.type == "cuda"
    if not wanted:
        return EAGER
    if model is None:
        return compiled_kernels()
    param = next(model.parameters())
    c = model.config
    return compiled_kernels((type(model).__name__, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, c.intermediate_size, c.rms_norm_eps, param.dtype, param.device.type))
