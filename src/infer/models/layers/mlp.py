"""The SwiGLU MLP's weights and the activation of the fused gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.config import ModelConfig
from infer.models.layers.linear import make_linear
from infer.models.layers.parallel import REPLICATED, Parallel

Tensor = torch.Tensor


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU activation of a fused [..., 2 * I] gate/up projection -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU's weights: fused gate/up (`column`-parallel), then down (`row`-parallel); applied by `Kernels.mlp`."""

    def __init__(self, config: ModelConfig, quantization: str | None = None, column: Parallel = REPLICATED,
                 row: Parallel = REPLICATED) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size, quantization, column)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, quantization, row)
