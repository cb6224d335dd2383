"""ForwardFn: the forward interface that the runner and the draft-model proposer call.

A forward function runs one model through its KV pool for a batch described by a
`BatchLayout`. The engine's executor provides it: eagerly (`engine/executor/forward.py`),
as CUDA graphs of the same computation (`engine/executor/graphs.py`), or mirrored on every
rank under tensor parallelism (`distributed/mirror.py`). It is declared here, below the
engine, because the draft-model proposer drives one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds
from infer.cache.view import BatchLayout
from infer.speculative.node_tree import RowTreeChunk
from infer.speculative.tree import TreeChunk


class ForwardFn(Protocol):
    """A forward pass through a pool: the flat batch forward (`run`, eager or replaying CUDA
    graphs), and the padded-layout calls of the proposers laid out on it."""

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        """The one forward: a step's rows laid out (`cache.forward_batch.plan_batch`) ->
        logits [M, V] of the tokens the rows ask for; the pool's lengths set to the rows' ends."""
        ...

    def __call__(self, ids: torch.Tensor, layout: BatchLayout, all_logits: bool) -> torch.Tensor:
        """ids: CPU [B, T] -> logits [B, T, V] (all_logits) or [B, V] (each row's last token).
        Commits the layout to the pool."""
        ...

    def sample(self, ids: torch.Tensor, layout: BatchLayout, temperatures: Sequence[float],
               uniforms: torch.Tensor, greedy: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """A last-token step, then temperature sampling: (ids [B], probs [B, V]) on the device."""
        ...

    def verify(self, ids: torch.Tensor, layout: BatchLayout, draft_tokens: torch.Tensor, counts: Sequence[int],
               draft_probs: torch.Tensor | None, temperatures: Sequence[float], greedy: Sequence[bool],
               uniforms: torch.Tensor) -> torch.Tensor:
        """A verification step, then rejection sampling: [B, K+2] long on the device."""
        ...

    def tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk) -> torch.Tensor:
        """A tree chunk (see `TreeChunk`; a `RowTreeChunk` has a tree per row): ids [B,
        chunk.width] (CPU, or the device) stored at the layout's positions, every row
        chunk.width wide (rows may be shorter: the rest is padding), rotary positions and
        visibility from the tree -> logits [B, width, V].
        Commits the layout to the pool."""
        ...

    def verify_tree(self, ids: torch.Tensor, layout: BatchLayout, chunk: TreeChunk | RowTreeChunk,
                    node_tokens: torch.Tensor,
                    node_valid: torch.Tensor, draft_probs: torch.Tensor | None, temperatures: Sequence[float],
                    greedy: Sequence[bool], uniforms: torch.Tensor) -> torch.Tensor:
        """A tree verification step (`tree` over the whole block), then the tree verifier for
        rows sampling with a temperature alone (greedy included): [B, 2 * depth + 2] long on
        the device, the verifier's packed rows then its accepted nodes. See
        `verify_on_tree_logits` for the arguments."""
        ...

    def prepare_trees(self, chunks: Iterable[TreeChunk], verify_modes: Iterable[str] = ()) -> None:
        """Capture `tree` graphs of these chunks for every batch bucket now, and for a
        verification chunk the tree verifier in these modes too (no-op when eager)."""
        ...

    def captured(self, layout: BatchLayout, all_logits: bool) -> bool:
        """Whether a CUDA graph serves this exact layout (callers pad to a captured width)."""
        ...
