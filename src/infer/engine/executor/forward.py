"""What runs on a forward's logits, on their device: temperature sampling (`sample_logits`),
a chain's and a tree's acceptance (`verify_on_logits`, `verify_on_tree_logits`), and a
draft round as steps of a forward function (`draft_steps`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.cache.view import BatchLayout
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.speculative.forward import ForwardFn
from infer.speculative.node_tree import TreeFrame
from infer.speculative.tree import TreeShape
from infer.speculative.verifier import verify_greedy_logits, verify_logits, verify_tree_greedy, verify_tree_logits
from infer.transfer import tensor_on, to_device


def sample_logits(logits: torch.Tensor, temperatures: Sequence[float], uniforms: torch.Tensor,
                  greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature sampling of last-token logits [n, V] on their device: (ids [n], probs
    [n, V]). temperatures: per row (1.0 for greedy rows); uniforms: CPU float64 [n]; greedy
    rows take the argmax (one-hot probs). The sampling half of `ForwardFn.sample`."""
    device = logits.device
    temps = tensor_on(list(temperatures), device, torch.float32)
    probs = temperature_probs(logits, temps, tensor_on(list(greedy), device, torch.bool))
    return sample_from_probs(probs, to_device(uniforms, device)), probs


def verify_on_logits(logits: torch.Tensor, draft_tokens: torch.Tensor, counts: Sequence[int],
                     draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
                     uniforms: torch.Tensor) -> torch.Tensor:
    """Rejection sampling on a verification step's logits [n, K+1, V] (rows sampled with a
    temperature alone, greedy included): [n, K+2] long on their device. The acceptance half
    of `ForwardFn.verify` (its arguments as there)."""
    device = logits.device
    tokens, num = to_device(draft_tokens, device), tensor_on(list(counts), device, torch.long)
    if all(greedy):
        return verify_greedy_logits(logits, tokens, num)
    return verify_logits(logits, tensor_on(list(temperatures), device, torch.float32),
                         tensor_on(list(greedy), device, torch.bool), tokens, num, draft_probs,
                         to_device(uniforms, device))


def verify_on_tree_logits(shape: TreeShape | TreeFrame, logits: torch.Tensor, node_tokens: torch.Tensor,
                          node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                          greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
    """The tree verifier on a verification step's logits [n, N+1, V] (rows sampled with a
    temperature alone, greedy included): [n, 2 * depth + 2] long on their device, packed
    rows (`verify_tree_nodes`) then accepted nodes. node_tokens, node_valid: CPU [n, N];
    draft_probs: [n, N, V] on the device or None (deterministic proposals); temperatures:
    per row (1.0 for greedy rows); uniforms: CPU float64 [n, U] (unread when all greedy)."""
    device = logits.device
    tokens, valid = to_device(node_tokens, device), to_device(node_valid, device)
    if all(greedy):
        packed, nodes = verify_tree_greedy(shape, logits, tokens, valid)
    else:
        packed, nodes = verify_tree_logits(shape, logits, tensor_on(list(temperatures), device, torch.float32),
                                           tensor_on(list(greedy), device, torch.bool), tokens, draft_probs,
                                           to_device(uniforms, device), valid)
    return torch.cat([packed, nodes], dim=1)


def draft_steps(forward: ForwardFn, ids: torch.Tensor, layout: BatchLayout, steps: int,
                temperatures: Sequence[float], uniforms: torch.Tensor,
                greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ForwardFn.draft_loop` as `steps` calls of `forward` (every row greedy: the logits'
    argmax) or `forward.sample`, step 1 feeding ids (CPU [n, w]), each later step the token
    the step before chose (staying on the device); see `EagerForward.draft_loop`."""
    n, width = ids.shape
    if layout.chunk_lens != (width + steps - 1,) * n:
        raise ValueError(f"draft_loop: every row of the layout must be {width + steps - 1} wide "
                         f"(ids width {width} + {steps - 1} steps), got {layout.chunk_lens}")
    tokens, probs = [], []
    step_ids = ids
    for s in range(steps):
        offset, w = (0, width) if s == 0 else (width + s - 1, 1)
        step = BatchLayout.of(layout.slots, [p + offset for p in layout.start_positions], [w] * n)
        if all(greedy):
            new = greedy_tokens(forward(step_ids, step, all_logits=False))  # [n]
        else:
            new, p = forward.sample(step_ids, step, temperatures, uniforms[:, s], greedy)  # [n], [n, V]
            probs.append(p)
        tokens.append(new)
        step_ids = new[:, None]
    return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)
