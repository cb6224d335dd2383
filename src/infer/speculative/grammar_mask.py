"""Grammar masks on the logits: packed token bitmasks (int32 [N, ceil(V / 32)], bit j of word w
allows token 32 w + j, xgrammar's layout), forbidden logits set to -inf before any sampling
transform. `GrammarState` is what the runner and the verifier need of a request's grammar
(`engine.structured.RequestGrammar`); a grammar that fails fails its request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from infer.speculative.faults import isolated
from infer.transfer import to_device


class GrammarState(Protocol):
    """A request's grammar: advances over emitted tokens, fills next-token masks."""

    vocab_size: int  # the bitmask's width is ceil(vocab_size / 32) words

    def accept(self, token_id: int) -> None: ...

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    def fill_after(self, bitmask: torch.Tensor, row: int, path: Sequence[int]) -> None: ...


class Constrained(Protocol):
    """A request as the masks see it: its grammar, and where a fault of it is recorded."""

    request_id: str
    fault: str | None
    grammar: GrammarState | None


def fill_row(request: Constrained, bitmask: torch.Tensor, row: int, path: Sequence[int] | None = None) -> None:
    """bitmask[row] := the request's grammar's mask at its state (after `path` when given);
    isolated: a grammar that fails leaves the row all-allowed and its request faulted."""
    grammar = request.grammar
    assert grammar is not None
    with isolated(request, "filling its grammar's token mask"):
        if path is None:
            grammar.fill(bitmask, row)
        else:
            grammar.fill_after(bitmask, row, path)
        return
    bitmask[row] = -1  # (reached when the fill failed)


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
    """A copy of logits [N, V] with the tokens forbidden by bitmask[i] set to -inf in row rows[i]."""
    out = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = allowed_tokens(to_device(bitmask, logits.device), logits.shape[-1])  # [len(rows), V]
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def grammar_masked(logits: torch.Tensor, requests: Sequence[Constrained],
                   paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """logits [N, V] masked by each row's grammar at its state, or after paths[i] when given (the
    logits themselves when no row has a grammar)."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    first = requests[rows[0]].grammar
    assert first is not None
    bitmask = allocate_bitmask(len(rows), first.vocab_size)
    for j, i in enumerate(rows):
        fill_row(requests[i], bitmask, j, None if paths is None else paths[i])
    return mask_logits(logits, bitmask, rows)
