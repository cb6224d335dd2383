"""HiddenCapture: the target's hidden states that an EAGLE head drafts from.

Point i < num_hidden_layers is the input of layer i (0: the embedding); i == num_hidden_layers
the final normed output. Every forward of the model (`LlamaForCausalLM.capture`) leaves `last`,
the points concatenated (no host sync: CUDA graphs capture it as a static output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HiddenCapture:
    points: tuple[int, ...]  # layer inputs (< num_hidden_layers), or num_hidden_layers: the final normed output
    last: torch.Tensor | None = field(default=None, repr=False)  # [B, T, len(points) * H] of the latest forward

    def __post_init__(self) -> None:
        if not self.points or any(not isinstance(p, int) or p < 0 for p in self.points):
            raise ValueError(f"HiddenCapture.points must be layer indices >= 0, got {self.points}")

    def check(self, num_hidden_layers: int) -> None:
        """Raise unless every point exists in a model of this many layers."""
        bad = [p for p in self.points if p > num_hidden_layers]
        if bad:
            raise ValueError(f"hidden-state capture points {bad} do not exist in a model of {num_hidden_layers} "
                             f"layers (layer inputs 0..{num_hidden_layers - 1}, or {num_hidden_layers}: the output)")

    def store(self, states: dict[int, torch.Tensor]) -> None:
        """states: point -> [B, T, H] of one forward."""
        self.last = torch.cat([states[p] for p in self.points], dim=-1)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The latest forward's features at flat rows (b * T + t): index [M] -> [M, D]."""
        assert self.last is not None, "no forward has run since the capture was attached"
        return self.last.reshape(-1, self.last.shape[-1]).index_select(0, index)
