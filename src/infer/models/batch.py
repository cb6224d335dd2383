"""ForwardBatch: the tokens of one forward pass as one flat batch, with the KV metadata attention reads.

Prefill chunks, decode rows, verification blocks and tree nodes are all rows of one batch, their
tokens end to end ([N]). Key position j of row b is in storage row
`block_tables[b, j // block_size] * block_size + j % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WORD = 64  # tree-rule bits per int64 word


def rule_words(width: int) -> int:
    """int64 words a token's rule over a block of `width` positions takes."""
    return -(-width // WORD)


@dataclass(frozen=True, slots=True)
class TreeRule:
    """Visibility inside tree blocks: token i sees key base[i] + c (0 <= c < width) only where bit
    c % 64 of bits[i, c // 64] is set; other keys follow the causal rule (outside a tree: base = pos + 1)."""

    bits: torch.Tensor  # [N, rule_words(width)] int64
    base: torch.Tensor  # [N] int64
    width: int

    def __post_init__(self) -> None:
        if self.width < 1 or self.bits.dim() != 2 or self.bits.shape[1] != rule_words(self.width):
            raise ValueError(f"a tree rule over {self.width} positions needs bits [N, {rule_words(self.width)}], "
                             f"got {tuple(self.bits.shape)}")


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

