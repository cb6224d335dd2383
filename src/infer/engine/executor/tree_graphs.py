"""CUDA graphs of the tree verifier (tree speculation), read by `GraphForward`.

After a tree verification graph (one per batch bucket and `TreeChunk`) has filled its
logits, a small second graph runs the whole tree verifier on them (`verify_tree_greedy`, or
`verify_tree_logits` for rows sampled with a temperature alone: one-hot q for deterministic
drafts, or a static [b, N, V] buffer of a draft model's q). The verifier is pure tensor code
looping over the static shape only, so it captures as is; a round's acceptance is then one
replay instead of a few hundred small launches. Inputs are staged like the chain's
acceptance graph (`graphs._Verifier`): node tokens and validity in one int64 transfer,
temperature | greedy | uniforms in one float64 transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.engine.executor.staging import _stage_sampling, _Staging
from infer.speculative.tree import TreeShape
from infer.speculative.verifier import verify_tree_greedy, verify_tree_logits

TREE_VERIFY_MODES = ("greedy", "one_hot", "draft_probs")  # as graphs.VERIFY_MODES
Record = Callable[[Callable[[], torch.Tensor]], tuple[torch.cuda.CUDAGraph, torch.Tensor]]


@dataclass
class TreeVerifier:
    """The tree verifier over the logits of one tree verification graph (same bucket)."""

    graph: torch.cuda.CUDAGraph
    longs: _Staging  # int64 [2 * b * N]: node tokens [b, N] | node valid [b, N] (0 / 1)
    floats: _Staging  # float64 [2 + U, b]: temperature | greedy | uniforms
    draft_probs: torch.Tensor | None  # [b, N, V] static input (model drafts); None: one-hot q
    out: torch.Tensor  # [b, 2 * depth + 2] long: packed rows | accepted nodes


def tree_verify_mode(greedy: Sequence[bool], draft_probs: torch.Tensor | None) -> str:
    return "greedy" if all(greedy) else "draft_probs" if draft_probs is not None else "one_hot"


def verify_staged(shape: TreeShape, mode: str, logits: torch.Tensor, longs: torch.Tensor, floats: torch.Tensor,
                  draft_probs: torch.Tensor | None) -> torch.Tensor:
    """What the verifier graph computes from its static inputs: logits [b, N+1, V], longs
    [2 * b * N] (`stage_nodes`), floats [2 + U, b] (`_stage_sampling`), draft_probs
    [b, N, V] or None -> [b, 2 * depth + 2] long."""
    b, n = logits.shape[0], shape.num_nodes
    tokens, valid = longs[:b * n].view(b, n), longs[b * n:].view(b, n) > 0  # [b, N]
    if mode == "greedy":
        packed, nodes = verify_tree_greedy(shape, logits, tokens, valid)
    else:
        packed, nodes = verify_tree_logits(shape, logits, floats[0].float(), floats[1] > 0.5, tokens, draft_probs,
                                           floats[2:].t(), valid)
    return torch.cat([packed, nodes], dim=1)


def stage_nodes(host: torch.Tensor, bucket: int, node_tokens: torch.Tensor, node_valid: torch.Tensor) -> None:
    """Fill the first n rows of an int64 [2 * bucket * N] host buffer: node tokens | validity."""
    n, width = node_tokens.shape
    host[:bucket * width].view(bucket, width)[:n] = node_tokens
    host[bucket * width:].view(bucket, width)[:n] = node_valid.to(torch.long)


@torch.inference_mode()
def capture_tree_verifier(record: Record, logits: torch.Tensor, shape: TreeShape, mode: str,
                          draft_probs: torch.Tensor | None) -> TreeVerifier:
    """The verifier reading `logits` [b, N+1, V] (a tree verification graph's output)."""
    if mode not in TREE_VERIFY_MODES:
        raise ValueError(f"tree verify mode must be one of {TREE_VERIFY_MODES}, got {mode!r}")
    b, device, n = logits.shape[0], logits.device, shape.num_nodes
    longs = torch.zeros(2 * b * n, dtype=torch.long, device=device)
    floats = torch.full((2 + shape.num_uniforms, b), 0.5, dtype=torch.float64, device=device)
    floats[:2] = 1.0  # temperature 1, greedy
    graph, out = record(lambda: verify_staged(shape, mode, logits, longs, floats, draft_probs))
    return TreeVerifier(graph, _Staging(longs), _Staging(floats), draft_probs, out)


def replay_tree_verifier(v: TreeVerifier, node_tokens: torch.Tensor, node_valid: torch.Tensor,
                         draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
                         uniforms: torch.Tensor) -> torch.Tensor:
    """Stage the first n rows' inputs (CPU node_tokens / node_valid [n, N], uniforms [n, U];
    draft_probs [n, N, V] on the device) and replay: [n, 2 * depth + 2] on the device.
    The tree verification graph must have run first (it fills the logits read here)."""
    n = node_tokens.shape[0]
    stage_nodes(v.longs.next_host(), v.out.shape[0], node_tokens, node_valid)
    _stage_sampling(v.floats, n, temperatures, greedy, uniforms)
    v.longs.send()
    v.floats.send()
    if v.draft_probs is not None:
        assert draft_probs is not None
        v.draft_probs[:n].copy_(draft_probs)
    v.graph.replay()
    return v.out[:n]
