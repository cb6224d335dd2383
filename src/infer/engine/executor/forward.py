"""What runs on a forward's logits, on their device: temperature sampling (`sample_logits`),
and a chain's and a tree's acceptance (`verify_on_logits`, `verify_on_tree_logits`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling import sample_from_probs, temperature_probs
from infer.speculative.forward import ForwardFn
from infer.speculative.node_tree import TreeFrame
from infer.speculative.tree import TreeShape
from infer.speculative.verifier import verify_greedy_logits, verify_logits, verify_tree_greedy, verify_tree_logits
from infer.transfer import tensor_on, to_device

__all__ = ["ForwardFn", "sample_logits", "verify_on_logits", "verify_on_tree_logits"]


def sample_logits(logits: torch.Tensor, temperatures: Sequence[float], uniforms: torch.Tensor,
                  greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling of last-token logits [n, V] on their device: (ids [n], probs
    [n, V]). temperatures: per row (1.0 for greedy rows); uniforms: CPU float64 [n]; greedy
    rows take the argmax (one-hot probs)."""
    device = logits.device
    temps = tensor_on(list(temperatures), device, torch.float32)
    probs = temperature_probs(logits, temps, tensor_on(list(greedy), device, torch.bool))
    return sample_from_probs(probs, to_device(uniforms, device)), probs


def verify_on_logits(logits: torch.Tensor, draft_tokens: torch.Tensor, counts: Sequence[int],
                     draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
                     uniforms: torch.Tensor) -> torch.Tensor:
    """Rejection sampling on a verification step's logits [n, K+1, V] (temperature-only rows):
    [n, K+2] long on their device (`verify_logits`'s arguments)."""
    device = logits.device
    tokens = to_device(draft_tokens, device)
    k = counts[0] if counts else 0
    num = (torch.full((len(counts),), k, dtype=torch.long, device=device) if all(c == k for c in counts)
           else tensor_on(list(counts), device, torch.long))  # (every row alike: nothing sent)
    if all(greedy):
        return verify_greedy_logits(logits, tokens, num)
    return verify_logits(logits, tensor_on(list(temperatures), device, torch.float32),
                         tensor_on(list(greedy), device, torch.bool), tokens, num, draft_probs,
                         to_device(uniforms, device))


def verify_on_tree_logits(shape: TreeShape | TreeFrame, logits: torch.Tensor, node_tokens: torch.Tensor,
                          node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                          greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
    """The tree verifier on a verification step's logits [n, N+1, V] (temperature-only rows):
    [n, 2 * depth + 2] long on their device, packed rows then accepted nodes. node_tokens,
    node_valid: CPU [n, N]; draft_probs: [n, N, V] or None (deterministic); uniforms: CPU
    float64 [n, U]."""
    device = logits.device
    tokens, valid = to_device(node_tokens, device), to_device(node_valid, device)
    if all(greedy):
        packed, nodes = verify_tree_greedy(shape, logits, tokens, valid)
    else:
        packed, nodes = verify_tree_logits(shape, logits, tensor_on(list(temperatures), device, torch.float32),
                                           tensor_on(list(greedy), device, torch.bool), tokens, draft_probs,
                                           to_device(uniforms, device), valid)
    return torch.cat([packed, nodes], dim=1)
