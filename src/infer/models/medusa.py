"""Medusa heads: K extra heads on the target's last hidden state, each guessing a later token.

Medusa (Cai et al., 2024), FasterDecoding's layout (models/loading/medusa_files.py). Head k
reads h, the target's final normed hidden state at position n - 1, and guesses t_{n+1+k}:
`medusa_num_layers` residual blocks x <- x + SiLU(W x + b), then its own lm_head [V, H].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.config import ModelConfig
from infer.models.kernels.bundle import EAGER, CompiledKernels, Kernels
from infer.models.layers.linear import LinearBase, make_linear



def _count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    """The heads' shape. hidden_size / vocab_size: the base model's (None: known only from the weights)."""

    num_heads: int
    num_layers: int
    hidden_size: int | None
    vocab_size: int | None
    source: str = "the Medusa heads"  # where it came from, for error messages

    def __post_init__(self) -> None:
        if not _count(self.num_heads, 1):
            raise ValueError(f"{self.source}: medusa_num_heads must be an integer >= 1, got {self.num_heads!r}")
        if not _count(self.num_layers, 0):
            raise ValueError(f"{self.source}: medusa_num_layers must be an integer >= 0, got {self.num_layers!r}")
        for name in ("hidden_size", "vocab_size"):
            value = getattr(self, name)
            if value is not None and not _count(value, 1):
                raise ValueError(f"{self.source}: {name} must be an integer >= 1, got {value!r}")

    def check_target(self, target: ModelConfig) -> None:
        """Raise (naming every mismatch) unless the known sizes match the target's."""
        problems = []
        if self.hidden_size is not None and self.hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.hidden_size} vs the target's {target.hidden_size}")
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} vs the target's {target.vocab_size}")
        if problems:
            raise ValueError(f"{self.source} do not fit the target: {'; '.join(problems)}. Use Medusa heads "
                             "trained for this target model")

    def check_depth(self, depth: int) -> None:
        """Raise unless a round of `depth` drafts (spec_length, a spec_tree's depth) has a head per depth."""
        if depth > self.num_heads:
            raise ValueError(f"{self.source} have {self.num_heads} heads, one per draft depth, but spec_length is "
                             f"{depth}: set spec_length (or the depth of spec_tree) to at most {self.num_heads}")


class MedusaHead(nn.Module):
    """The heads' weights and forward: `blocks[k][l]` head k's residual blocks, `lm_heads[k]` its projection."""

    def __init__(self, spec: MedusaConfig, quantization: str | None = None) -> None:
        super().__init__()
        if spec.hidden_size is None or spec.vocab_size is None:
            raise ValueError(f"{spec.source}: the hidden size and vocabulary must be known to build the heads")
        self.spec = spec
        h, v = spec.hidden_size, spec.vocab_size
        self.blocks = nn.ModuleList(
            nn.ModuleList(make_linear(h, h, quantization, bias=True) for _ in range(spec.num_layers))
            for _ in range(spec.num_heads))
        self.lm_heads = nn.ModuleList(make_linear(h, v, quantization) for _ in range(spec.num_heads))
        self.compiled = CompiledKernels()  # its fused bundle, compiled at first use (its rounds on a GPU)

    def linears(self) -> dict[str, LinearBase]:
        """Every projection by its checkpoint name: `{k}.{l}.linear` (blocks), `{k}.{L}` (lm_heads)."""
        out: dict[str, LinearBase] = {}
        for k, (blocks, head) in enumerate(zip(self.blocks, self.lm_heads, strict=True)):
            out.update({f"{k}.{l}.linear": block for l, block in enumerate(blocks)})
            out[f"{k}.{self.spec.num_layers}"] = head
        return out

    def logits(self, k: int, hidden: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Head k on hidden states [A, H] -> its logits [A, V] (the model's dtype)."""
        x = hidden
        for block in self.blocks[k]:
            x = x + F.silu(kernels.linear(block, x, None))
        return kernels.linear(self.lm_heads[k], x, None)

    def top_tokens(self, hidden: torch.Tensor, widths: Sequence[int], kernels: Kernels = EAGER) -> torch.Tensor:
        """Head k's widths[k] best tokens for each row, best first, heads 0..len(widths)-1:
        hidden [A, H] -> token ids [A, sum(widths)] (on the device)."""
        if not 1 <= len(widths) <= self.spec.num_heads:
            raise ValueError(f"{self.spec.source}: asked for {len(widths)} heads of {self.spec.num_heads}")
        parts = [_best(self.logits(k, hidden, kernels), w) for k, w in enumerate(widths)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _best(logits: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` highest logits' ids, best first: [A, V] -> [A, width] (argmax for one)."""
    if width == 1:
        return torch.argmax(logits, dim=-1, keepdim=True)
    return torch.topk(logits, width, dim=-1).indices


def build_head(spec: MedusaConfig, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> MedusaHead:
    """Heads of `spec` on `device`, weights uninitialised in `dtype` (quantized layers keep theirs)."""
    with torch.device("meta"):
        head = MedusaHead(spec, quantization)
    return head.to(dtype=dtype).to_empty(device=device)
