"""Log-probabilities of emitted tokens: what `SamplingParams.logprobs` asks for.

Reported from the model's raw distribution, `log_softmax(logits)` before any penalty,
temperature, top-k or top-p (vLLM's default); under speculative decoding from the target's
logits, so the numbers are the same as plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One emitted token's log-probability and the `N` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int],
                   counts: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """logits [N, V], the token emitted from each row, and per row how many alternatives
    to report (None: no log-probabilities for that row) -> one entry per row."""
    if logits.dim() != 2 or len(tokens) != logits.shape[0] or len(counts) != logits.shape[0]:
        raise ValueError(f"need logits [N, V] with N tokens and N counts, got {tuple(logits.shape)}, "
                         f"{len(tokens)} tokens, {len(counts)} counts")
    rows = [i for i, c in enumerate(counts) if c is not None]
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index].to(torch.float32), dim=-1)  # [R, V]
    # (a NO_TOKEN, -1, of a faulted row reads id 0: the row's request fails, its entry is never shown)
    chosen_ids = torch.tensor([max(tokens[i], 0) for i in rows], device=logits.device)
    chosen = lp.gather(1, chosen_ids[:, None])[:, 0].tolist()  # [R]
    k = max(counts[i] or 0 for i in rows)
    top_vals, top_ids = ([], []) if k == 0 else (t.tolist() for t in lp.topk(k, dim=-1))  # [R, k] each
    for j, i in enumerate(rows):
        n = counts[i] or 0
        top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else ()
        out[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return out


def emitted_logprobs(logits: torch.Tensor, tokens: Sequence[Sequence[int]],
                     counts: Sequence[int | None]) -> list[list[TokenLogprobs]] | None:
    """Speculative verification: logits [B, W, V], the tokens each row emits (token j from
    position j), per-row counts -> per row, one entry per emitted token; None when none asks."""
    if all(c is None for c in counts):
        return None
    flat_rows = [(b, j) for b, row in enumerate(tokens) if counts[b] is not None for j in range(len(row))]
    if not flat_rows:
        return [[] for _ in tokens]
    b_idx = torch.tensor([b for b, _ in flat_rows], device=logits.device)
    j_idx = torch.tensor([j for _, j in flat_rows], device=logits.device)
    flat = token_logprobs(logits[b_idx, j_idx], [tokens[b][j] for b, j in flat_rows],
                          [counts[b] for b, _ in flat_rows])
    out: list[list[TokenLogprobs]] = [[] for _ in tokens]
    for (b, _), entry in zip(flat_rows, flat, strict=True):
        assert entry is not None
        out[b].append(entry)
    return out
