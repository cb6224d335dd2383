"""The SwiGLU MLP: its weights (gate and up fused into one matrix, then down) and the
activation of the fused gate/up output."""

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
    """SwiGLU's weights: gate and up projections fused into one matrix, then down. The decoder
    layer applies them through its kernel bundle (`Kernels.mlp`). Under tensor parallelism
    gate/up are `column`-parallel and down `row`-parallel (config: the rank's shape)."""

    def __init__(self, config: ModelConfig, quantization: str | None = None, column: Parallel = REPLICATED,
                 row: Parallel = REPLICATED) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size, quantization, column)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, quantization, row)
