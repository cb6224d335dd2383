"""The steps of a batched chain draft, shared by the draft model and the EAGLE head: `ChainSteps`
(a round's sampling state and outputs) and `row_uniforms` (each row's from its own generator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling import (NO_TOKEN, SamplingParams, draw_uniforms, greedy_tokens, logits_to_probs,
                            sample_from_probs)
from infer.speculative.faults import mark_fault
from infer.speculative.grammar_mask import grammar_masked
from infer.speculative.proposer import DraftRequest


@dataclass(slots=True)
class ChainSteps:
    params: list[SamplingParams]
    greedy: bool  # every row greedy without a penalty: argmax, no q
    contexts: list[list[int]] | None  # each row's tokens, grown by its drafts (when a row is penalised)
    reqs: list[DraftRequest]  # each row's request (its grammar, where its faults are recorded)
    drafted: list[list[int]] | None  # each row's drafts so far (when a row has a grammar)
    tokens: torch.Tensor  # [B, K] long, on the draft's device
    probs: torch.Tensor | None = None  # [B, K, V] q, from the first step that samples

    @classmethod
    def of(cls, reqs: Sequence[DraftRequest], k_max: int, device: torch.device | str) -> ChainSteps:
        params = [r.sampling_params for r in reqs]
        return cls(params, all(p.greedy and not p.penalized for p in params),
                   [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None,
                   list(reqs), [[] for _ in reqs] if any(r.grammar is not None for r in reqs) else None,
                   torch.zeros((len(reqs), k_max), dtype=torch.long, device=device))

    @property
    def host_bound(self) -> bool:
        """Whether each step needs the last one's tokens on the host (a penalty or a grammar)."""
        return self.contexts is not None or self.drafted is not None

    def draw(self, logits: torch.Tensor, alive: Sequence[int],
             uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step for the batch rows `alive`: logits [A', V], uniforms [A'] -> (tokens [A'], q [A', V]
        or None when every row is greedy); q is after each row's grammar mask and penalties."""
        if self.drafted is not None:
            logits = grammar_masked(logits, [self.reqs[b] for b in alive], [self.drafted[b] for b in alive])
        probs = None
        if self.greedy:
            new = greedy_tokens(logits)  # [A']
        else:
            assert uniforms is not None
            probs = logits_to_probs(logits, [self.params[b] for b in alive],
                                    None if self.contexts is None else [self.contexts[b] for b in alive])  # [A', V]
            new = sample_from_probs(probs, uniforms)
        if self.host_bound:  # the next mask or penalty needs the tokens
            for b, t in zip(alive, new.tolist(), strict=True):
                if t == NO_TOKEN:  # (the row's request fails; its later steps read token 0)
                    mark_fault(self.reqs[b], f"request {self.reqs[b].request_id} failed while drafting: the "
                                             "draft's logits were not finite or allowed no token")
                    t = 0
                for grown in (self.contexts, self.drafted):
                    if grown is not None:
                        grown[b].append(t)
        return new, probs

    def put(self, rows: torch.Tensor, step: int, new: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Step `step`'s tokens new [A'] (and q [A', V]) of the batch rows `rows` [A']."""
        if probs is not None:
            if self.probs is None:
                self.probs = torch.zeros((*self.tokens.shape, probs.shape[-1]), dtype=probs.dtype,
                                         device=probs.device)
            self.probs[rows, step] = probs
        self.tokens[rows, step] = new

    def rows(self, ks: Sequence[int]) -> list[list[int]]:
        """Each row's first k_b tokens (the round's one sync, without penalties or grammars)."""
        return [row[:k] for row, k in zip(self.tokens.tolist(), ks, strict=True)]


def row_uniforms(reqs: Sequence[DraftRequest], ks: Sequence[int]) -> torch.Tensor:
    """[B, max k] uniforms; row b draws exactly k_b from its own generator (independent of the batch)."""
    out = torch.zeros((len(reqs), max(ks)), dtype=torch.float64)
    for b, (r, k) in enumerate(zip(reqs, ks, strict=True)):
        out[b, :k] = draw_uniforms([r.generator], k)[0]
    return out
