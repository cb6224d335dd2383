"""Grammar masks on the logits: packed token bitmasks (int32 [N, ceil(V / 32)], bit j of word w
allows token 32 w + j, xgrammar's layout) unpacked on the logits' device, forbidden logits set
to -inf before any sampling transform. Greedy and sampled decoding and the verifier's target
distribution are then all the masked ones.

`GrammarState` is what the runner and the verifier need of a request's grammar
(`engine.structured.RequestGrammar` implements it with xgrammar).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from infer.transfer import to_device


class GrammarState(Protocol):
    """A request's grammar: advances over emitted tokens, fills next-token masks."""

    vocab_size: int  # the bitmask's width is ceil(vocab_size / 32) words

    def accept(self, token_id: int) -> None: ...

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    def fill_after(self, bitmask: torch.Tensor, row: int, path: Sequence[int]) -> None: ...


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] on the CPU, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack bitmask [N, W] int32 -> bool [N, vocab] (tokens past 32 W are forbidden)."""
    ids = torch.arange(vocab, device=bitmask.device)  # [V]
    words = ids // 32
    inside = words < bitmask.shape[1]  # [V]
    picked = bitmask[:, words.clamp(max=bitmask.shape[1] - 1)]  # [N, V]
    return ((picked >> (ids % 32)) & 1).bool() & inside


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A copy of logits [N, V] with the tokens forbidden by bitmask[i] set to -inf in row
    rows[i] (the other rows untouched)."""
    out = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = allowed_tokens(to_device(bitmask, logits.device), logits.shape[-1])  # [len(rows), V]
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def grammar_masked(logits: torch.Tensor, grammars: Sequence[GrammarState | None],
                   paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """logits [N, V] restricted by each row's grammar at its current state, or after
    paths[i] when given (a draft's tokens so far); rows without one untouched; the logits
    themselves when no row has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    first = grammars[rows[0]]
    assert first is not None
    bitmask = allocate_bitmask(len(rows), first.vocab_size)
    for j, i in enumerate(rows):
        grammar = grammars[i]
        assert grammar is not None
        if paths is None:
            grammar.fill(bitmask, j)
        else:
            grammar.fill_after(bitmask, j, paths[i])
    return mask_logits(logits, bitmask, rows)
