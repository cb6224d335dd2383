"""The pure logits -> probabilities pipeline, and sampling from its probabilities.

Every decoding rule is cast as plain sampling from one adjusted distribution (Leviathan et al. 2023, section 2.2,
"standardized sampling"), which the speculative verifier compares for draft and target. `adjust_logits` /
`logits_to_probs`: penalties, temperature, top-k, top-p; `sample`: one float64 uniform a row, CDF inverted;
`sample_without_replacement` draws a tree's siblings. docs/speculation.md, "Sampling transforms"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from infer.sampling.draws import draw_uniforms
from infer.sampling.params import SamplingParams
from infer.transfer import tensor_on, to_device

# One row's context for the repetition penalty: token ids as a list or a 1-D tensor.
Context = Sequence[int] | torch.Tensor

NO_TOKEN = -1  # a sampled id standing for "this row had no valid distribution" (its request's fault)


def _check_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 contexts: Sequence[Context] | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"params has {len(params)} entries but logits has {logits.shape[0]} rows")
    if contexts is not None and len(contexts) != logits.shape[0]:
        raise ValueError(f"contexts has {len(contexts)} entries but logits has {logits.shape[0]} rows")


def _context_ids(ctx: Context) -> torch.Tensor:
    """One row's context as a 1-D long tensor (lists go through numpy: far faster than torch.tensor)."""
    if isinstance(ctx, torch.Tensor):
        return ctx.reshape(-1).to(torch.long)
    return torch.from_numpy(np.fromiter(ctx, dtype=np.int64, count=len(ctx)))


def _penalty_indices(params: Sequence[SamplingParams], contexts: Sequence[Context], vocab: int,
                     device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """(penalized rows [R], local row index [M] in 0..R-1, token ids [M] on `device`) over every
    context token of each penalized row; None when no row has one."""
    rows, parts = [], []
    for row, (p, ctx) in enumerate(zip(params, contexts)):
        if p.penalized and len(ctx) > 0:
            rows.append(row)
            parts.append(_context_ids(ctx))
    if not rows:
        return None
    lengths = torch.tensor([t.numel() for t in parts])  # [R]
    if all(t.device.type == "cpu" for t in parts):
        ids = torch.cat(parts)  # [M] on CPU: range check without a device sync
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"contexts hold token ids outside [0, {vocab}): check the prompt token ids")
        ids = to_device(ids, device)
    else:  # ids already on a device are trusted (checking them would cost a host sync)
        ids = torch.cat([to_device(t, device) for t in parts])  # [M]
    local = to_device(torch.repeat_interleave(torch.arange(len(rows)), lengths), device)  # [M]
    return rows, local, ids


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                     contexts: Sequence[Context] | None) -> None:
    """In place on float32 logits [N, V]: each penalized row's penalties over its context ids
    (repetition once per token, presence / frequency by its count)."""
    if contexts is None:
        return
    found = _penalty_indices(params, contexts, logits.shape[1], logits.device)
    if found is None:
        return
    rows, local, ids = found  # [R], [M], [M]
    dev = logits.device
    index = tensor_on(rows, dev)  # [R] rows of `logits`
    repetition = [params[r].repetition_penalty for r in rows]
    if any(r != 1.0 for r in repetition):
        row_ids = index[local]  # [M]
        rep = tensor_on(repetition, dev, torch.float32)[local]  # [M]
        vals = logits[row_ids, ids]  # [M]
        logits[row_ids, ids] = torch.where(vals > 0, vals / rep, vals * rep)
    presence = [params[r].presence_penalty for r in rows]
    frequency = [params[r].frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        counts = torch.zeros((len(rows), logits.shape[1]), dtype=torch.float32, device=dev)  # [R, V]
        counts.index_put_((local, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        shift = (tensor_on(frequency, dev, torch.float32)[:, None] * counts
                 + tensor_on(presence, dev, torch.float32)[:, None] * (counts > 0))  # [R, V]
        logits[index] = logits[index] - shift


def _truncation_cutoff(sorted_desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest logit kept per row by top-k then top-p. sorted_desc [M, V] -> [M, 1]."""
    vocab = sorted_desc.shape[1]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)  # [M]
    cutoff_k = sorted_desc.gather(1, (k - 1)[:, None])  # [M, 1]
    kept = torch.where(sorted_desc >= cutoff_k, sorted_desc, float("-inf"))  # [M, V]
    probs = torch.softmax(kept, dim=-1)  # [M, V]
    cum = torch.cumsum(probs, dim=-1)  # [M, V]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # [M, V]
    count = (mass_before < top_p[:, None]).sum(dim=1).clamp(min=1)  # [M]
    cutoff_p = kept.gather(1, (count - 1)[:, None])  # [M, 1]
    cutoff_p = torch.where(top_p[:, None] >= 1.0, float("-inf"), cutoff_p)
    return torch.maximum(cutoff_k, cutoff_p)


def _apply_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p set with -inf. scaled [N, V] float32."""
    vocab = scaled.shape[1]
    rows = [i for i, p in enumerate(params)
            if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if not rows:
        return scaled  # no sort needed
    dev = scaled.device
    idx = tensor_on(rows, dev)  # [M]
    top_k = tensor_on([params[i].top_k for i in rows], dev)  # [M]
    top_p = tensor_on([params[i].top_p for i in rows], dev, torch.float32)  # [M]
    sub = scaled[idx]  # [M, V]
    sorted_desc = torch.sort(sub, dim=-1, descending=True).values  # [M, V]
    cutoff = _truncation_cutoff(sorted_desc, top_k, top_p)  # [M, 1]
    scaled[idx] = torch.where(sub >= cutoff, sub, float("-inf"))
    return scaled


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  contexts: Sequence[Context] | None) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] after penalties, temperature, top-k, top-p (input unchanged).

    `contexts[i]`: the token ids row i has seen (prompt + generated), a list or a 1-D tensor, read
    by the penalties only. Greedy rows get the penalties but no scaling or truncation.
    """
    _check_batch(logits, params, contexts)
    out = logits.to(torch.float32, copy=True)  # [N, V]
    _apply_penalties(out, params, contexts)
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        out = out / tensor_on(temps, out.device, torch.float32)[:, None]
    return _apply_top_k_top_p(out, params)


def logits_to_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                    contexts: Sequence[Context] | None) -> torch.Tensor:
    """float32 [N, V] sampling distributions; greedy rows are one-hot at the penalised argmax."""
    adjusted = adjust_logits(logits, params, contexts)  # [N, V]
    probs = torch.softmax(adjusted, dim=-1)  # [N, V]
    greedy = [p.greedy for p in params]
    if any(greedy):
        mask = tensor_on(greedy, probs.device)[:, None]  # [N, 1]
        probs = torch.where(mask, one_hot_max(adjusted), probs)
    return probs


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, or NO_TOKEN where the row's maximum is not finite
    (NaN or infinite logits, or every token forbidden): scores [..., V] -> ids [...] long."""
    best, idx = scores.max(dim=-1)
    return torch.where(torch.isfinite(best), idx, NO_TOKEN)


def one_hot_max(scores: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] one-hot at each row's argmax; a row whose maximum is not finite is NaN
    throughout, so sampling from it gives NO_TOKEN."""
    best, idx = scores.max(dim=-1, keepdim=True)  # [N, 1]
    one_hot = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device).scatter_(1, idx, 1.0)
    return torch.where(torch.isfinite(best), one_hot, float("nan"))


def temperature_only(params: SamplingParams, vocab: int) -> bool:
    """True when the only transform is a temperature (or greedy): no top-k, top-p, penalty."""
    return not params.penalized and (params.greedy or (not 0 < params.top_k < vocab
                                                                    and params.top_p >= 1.0))


def temperature_probs(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """`logits_to_probs`' exact values for temperature-only rows, without host branching (CUDA graphs):
    logits [N, V], temperatures [N] float32 (1.0 for greedy rows), greedy [N] bool -> float32 [N, V]."""
    scaled = logits.to(torch.float32) / temperatures[:, None]  # [N, V]
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    return torch.where(greedy[:, None], one_hot_max(scaled), probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in float64: probs [N, V] (need not be normalised), uniforms [N] -> ids [N] long.

    Never returns a token of probability 0 (a pick landing on one moves to the nearest positive
    token before it); a row without a finite positive total gives NO_TOKEN (the request's fault).
    """
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(
            f"probs must be [N, V] and uniforms [N], got {tuple(probs.shape)} and {tuple(uniforms.shape)}")
    vocab = probs.shape[1]
    p = probs.to(torch.float64)  # [N, V]
    cdf = torch.cumsum(p, dim=-1)  # [N, V]
    u = to_device(uniforms, p.device).to(torch.float64)[:, None]  # [N, 1]
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)  # [N, 1]
    positive = p > 0  # [N, V]
    arange = torch.arange(vocab, device=p.device)[None, :]  # [1, V]
    # the last positive token at or before idx (one reduction, not a scan with indices)
    chosen = torch.where(positive & (arange <= idx), arange, -1).amax(dim=-1)  # [N]
    first_positive = positive.to(torch.int32).argmax(dim=-1)  # [N]
    total = cdf[:, -1]  # [N]
    ok = torch.isfinite(total) & (total > 0)
    return torch.where(ok, torch.where(chosen >= 0, chosen, first_positive), NO_TOKEN)


def sample_without_replacement(probs: torch.Tensor, uniforms: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W distinct draws a row, each from `probs` renormalised over the tokens not drawn yet (draw w
    with uniform w): probs [M, V] >= 0, uniforms [M, W] -> (ids [M, W] long, the distribution each
    was drawn from [M, W, V], drawn [M, W] bool; a draw with no mass left: id 0, all-zero q)."""
    if probs.dim() != 2 or uniforms.dim() != 2 or uniforms.shape[0] != probs.shape[0]:
        raise ValueError(f"probs must be [M, V] and uniforms [M, W], got {tuple(probs.shape)} "
                         f"and {tuple(uniforms.shape)}")
    rest = probs.clone()  # [M, V]: the mass not drawn yet
    ids, dists, drawn = [], [], []
    for w in range(uniforms.shape[1]):
        mass = rest.sum(dim=-1, keepdim=True)  # [M, 1]
        ok = mass[:, 0] > 0  # [M]
        dist = torch.where(ok[:, None], rest / torch.where(ok[:, None], mass, 1.0), 0.0)  # [M, V]
        x = torch.where(ok, sample_from_probs(dist, uniforms[:, w]), 0)  # [M]
        rest = rest.scatter(1, x[:, None], 0.0)
        ids.append(x)
        dists.append(dist)
        drawn.append(ok)
    return torch.stack(ids, dim=1), torch.stack(dists, dim=1), torch.stack(drawn, dim=1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           contexts: Sequence[Context] | None,
           generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row: logits [N, V] -> ids [N] long (one uniform drawn per row)."""
    if len(generators) != logits.shape[0]:
        raise ValueError(f"generators has {len(generators)} entries but logits has {logits.shape[0]} rows")
    probs = logits_to_probs(logits, params, contexts)  # [N, V]
    return sample_from_probs(probs, draw_uniforms(generators, 1)[:, 0])
