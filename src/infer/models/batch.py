"""ForwardBatch: the tokens of one forward pass as one flat batch, with the KV metadata
attention reads.

Prefill chunks, decode rows, verification blocks (K + 1 tokens a row) and tree nodes are
all rows of one batch: their tokens lie end to end ([N]), `query_start` says where each
row's begin, and each token carries its storage position (what it may see: keys at
positions <= its own, below its row's `seq_lens`), its rotary position (a tree node's is
its depth past the block, not its storage place) and the KV slot it writes. Keys are
read through `block_tables` (key position j of row b is in storage row
`block_tables[b, j // block_size] * block_size + j % block_size`). A tree's rule inside
its block (a node sees its ancestors only) is per token: an ancestor bit set and the
block's first position (`TreeRule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_BLOCK = 63  # widest tree block whose rule fits an int64 bit set (bit 63 is the sign)


@dataclass(frozen=True, slots=True)
class TreeRule:
    """Visibility inside tree blocks: token i sees block key base[i] + c (0 <= c < width)
    only where bit c of bits[i] is set; keys outside [base, base + width) follow the causal
    rule. A token outside any tree has base past every key (its own position + 1)."""

    bits: torch.Tensor  # [N] int64
    base: torch.Tensor  # [N] int64
    width: int  # W <= MAX_TREE_BLOCK

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_TREE_BLOCK:
            raise ValueError(f"a tree block must be 1..{MAX_TREE_BLOCK} positions wide, got {self.width}")


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long: storage position (the token sees keys at positions <= it)
    rope_positions: torch.Tensor  # [N] long: rotary positions (a tree node: its row's n + depth)
    slots: torch.Tensor  # [N] long: the KV storage row each token writes (padding: the scratch row)
    token_rows: torch.Tensor  # [N] long: each token's batch row
    block_tables: torch.Tensor  # [B, max_blocks] long
    query_start: torch.Tensor  # [B + 1] long: row b's tokens are query_start[b]:query_start[b + 1]
    seq_lens: torch.Tensor  # [B] long: each row's context length after this pass
    logits_indices: torch.Tensor  # [M] long: the tokens whose logits are wanted
    tree: TreeRule | None  # per-token tree visibility, or None (causal everywhere)
    # host facts the kernels plan with (fixed for a CUDA graph; never read from the device)
    query_lens: tuple[int, ...]  # [B] tokens per row
    context_width: int  # a bound on seq_lens (the split-KV plan)
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)
