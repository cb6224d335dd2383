"""Speculative verification: accept draft tokens by rejection sampling, batched and pure.

Implements the accept / recover / bonus step of Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1 and section 2.3 (losslessness proof in
their Appendix A.1). Draft token t_i is accepted iff u_i < p_i(t_i) / q_i(t_i), i.e. with
probability min(1, p/q); verification stops at the first rejection j, whose replacement is
drawn from norm(max(0, p_j - q_j)); when all k drafts pass, a bonus token is drawn from
p_k. The emitted tokens are then distributed exactly as sampling from p alone.

p and q are the distributions *after* the request's sampling transforms
(`infer.sampling.logits_to_probs`), so the rule is lossless for every setting:
- greedy target rows (one-hot p) reduce to "accept while draft == argmax, then emit the
  argmax" with no special case (p/q is 0 or >= 1, and the residual is one-hot at the argmax);
- deterministic proposals (n-gram, `draft_probs=None`) use a one-hot q: t is accepted with
  probability p(t) and the replacement comes from p with t removed, renormalised.

All arithmetic is vectorised over the batch on the tensors' device, in float64; the only
host synchronisation is the final copy of the token ids into Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling import sample_from_probs
from infer.transfer import tensor_on, to_device

# A residual max(0, p - q) with less total mass than this is rounding noise (p == q up to
# float error); the replacement token is then drawn from p itself.
MIN_RESIDUAL_MASS = 1e-12


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Per row: accepted draft tokens then exactly one recovered or bonus token."""

    tokens: list[list[int]]  # per row, num_accepted[row] + 1 token ids
    num_accepted: list[int]  # per row, 0 .. num_draft[row]


def _token_ratios(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """p(t) / q(t) in float64: p, q [..., V], tokens [...] -> [...]; q None = one-hot at t.

    q(t) = 0 gives inf where p(t) > 0 and NaN where p(t) = 0 (NaN compares false: reject).
    """
    p_tok = p.gather(-1, tokens[..., None]).squeeze(-1).to(torch.float64)  # [...]
    if q is None:
        return p_tok
    q_tok = q.gather(-1, tokens[..., None]).squeeze(-1).to(torch.float64)  # [...]
    return p_tok / q_tok


def acceptance_probabilities(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """min(1, p(t) / q(t)) as float64: p, q [..., V], tokens [...] long -> [...].

    q None means a deterministic proposal (one-hot q at t): the probability is p(t).
    Where q(t) = 0 the result is 1 if p(t) > 0, else 0.
    """
    ratio = _token_ratios(p, q, to_device(tokens, p.device).to(torch.long))  # [...]
    return torch.nan_to_num(ratio, nan=0.0).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) as float64 [..., V]; falls back to norm(p) where that mass is ~0."""
    p64 = p.to(torch.float64)  # [..., V]
    residual = (p64 - q.to(torch.float64)).clamp(min=0.0)  # [..., V]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    use_p = mass <= MIN_RESIDUAL_MASS  # [..., 1]
    chosen = torch.where(use_p, p64, residual)  # [..., V]
    return chosen / chosen.sum(dim=-1, keepdim=True)


def _check_inputs(draft_tokens: torch.Tensor, num_draft: Sequence[int], draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                  sample_uniforms: torch.Tensor) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, K], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if len(num_draft) != batch or any(not 0 <= n <= k for n in num_draft):
        raise ValueError(f"num_draft must hold {batch} counts in [0, {k}], got {list(num_draft)}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [{batch}, {k + 1}, vocab], got shape {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be None or [{batch}, {k}, {vocab}], got shape {tuple(draft_probs.shape)}")
    if tuple(accept_uniforms.shape) != (batch, k):
        raise ValueError(f"accept_uniforms must be [{batch}, {k}], got shape {tuple(accept_uniforms.shape)}")
    if tuple(sample_uniforms.shape) != (batch,):
        raise ValueError(f"sample_uniforms must be [{batch}], got shape {tuple(sample_uniforms.shape)}")


def _final_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        tokens: torch.Tensor, num_accepted: torch.Tensor,
                        rejected: torch.Tensor) -> torch.Tensor:
    """[B, V] distribution of the extra token: residual at a rejection, else p at the bonus slot."""
    batch, k = tokens.shape
    rows = torch.arange(batch, device=target_probs.device)  # [B]
    p = target_probs[rows, num_accepted].to(torch.float64)  # [B, V]
    if k == 0:
        return p
    j = num_accepted.clamp(max=k - 1)  # [B]: the rejected position where rejected
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, tokens[rows, j][:, None], 1.0)  # [B, V] one-hot
    else:
        q = draft_probs[rows, j]  # [B, V]
    return torch.where(rejected[:, None], residual_distribution(p, q), p)


def verify(draft_tokens: torch.Tensor, num_draft: Sequence[int], draft_probs: torch.Tensor | None,
           target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
           sample_uniforms: torch.Tensor) -> VerifyResult:
    """Rejection-sample a batch of drafts against the target (Algorithm 1).

    draft_tokens [B, K] long (row b uses its first num_draft[b]; the rest is padding),
    draft_probs [B, K, V] or None (deterministic proposals), target_probs [B, K+1, V]
    (position i is the target's distribution for draft i; position k_b gives the bonus),
    accept_uniforms [B, K] and sample_uniforms [B] in [0, 1).
    """
    _check_inputs(draft_tokens, num_draft, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    device = target_probs.device
    batch, k = draft_tokens.shape
    counts = tensor_on(list(num_draft), device, torch.long)  # [B]
    valid = torch.arange(k, device=device)[None, :] < counts[:, None]  # [B, K]
    tokens = torch.where(valid, to_device(draft_tokens, device).to(torch.long), 0)  # [B, K]
    q = None if draft_probs is None else to_device(draft_probs, device)
    ratio = _token_ratios(target_probs[:, :k], q, tokens)  # [B, K]
    u = to_device(accept_uniforms, device).to(torch.float64)  # [B, K]
    accepted = (u < ratio) & valid  # [B, K]
    num_accepted = accepted.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]: accepted prefix length
    rejected = num_accepted < counts  # [B]
    final = _final_distribution(target_probs, q, tokens, num_accepted, rejected)  # [B, V]
    extra = sample_from_probs(final, sample_uniforms)  # [B]
    packed = torch.cat([tokens.reshape(-1), num_accepted, extra]).cpu().tolist()  # one host sync
    return _unpack(packed, batch, k)


def _unpack(packed: list[int], batch: int, k: int) -> VerifyResult:
    drafts = packed[: batch * k]
    num_accepted = packed[batch * k: batch * k + batch]
    extra = packed[batch * k + batch:]
    tokens = [drafts[b * k: b * k + n] + [extra[b]] for b, n in enumerate(num_accepted)]
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)
