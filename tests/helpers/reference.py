"""A reference decoder for tests: tokens and log-probabilities from full forwards of a model
(no KV cache), with the penalties and inverse-CDF sampling written out by hand, so engine
and server outputs can be checked against the model's own logits."""

from __future__ import annotations

from typing import Any

import torch

from infer.sampling import SamplingParams, make_generator

TOP = 3


def reference(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[Any]]:
    """(tokens, per token (logprob, top ids)) from full forwards of the model."""
    ids, tokens, lps = list(prompt), [], []
    gen = make_generator(params.seed)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([ids]))[0, -1].to(torch.float32)  # [V]
            adj = logits.clone()
            for t in set(ids):
                v = adj[t].item()
                v = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
                adj[t] = v - ids.count(t) * params.frequency_penalty - params.presence_penalty
            if params.temperature == 0:
                token = int(adj.argmax())
            else:
                cdf = torch.cumsum(torch.softmax(adj / params.temperature, dim=-1).to(torch.float64), dim=0)
                u = torch.rand(1, generator=gen, dtype=torch.float64)
                token = int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(cdf) - 1))
            log_probs = torch.log_softmax(logits, dim=-1)
            lps.append((log_probs[token].item(), log_probs.topk(TOP).indices.tolist()))
            tokens.append(token)
            ids.append(token)
    return tokens, lps
