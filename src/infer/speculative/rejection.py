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

from infer.logprobs import TokenLogprobs

from infer.sampling import sample_from_probs, temperature_probs
from infer.transfer import tensor_on, to_device

# A residual max(0, p - q) with less total mass than this is rounding noise (p == q up to
# float error); the replacement token is then drawn from p itself.
MIN_RESIDUAL_MASS = 1e-12


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Per row: accepted draft tokens then exactly one recovered or bonus token."""

    tokens: list[list[int]]  # per row, num_accepted[row] + 1 token ids
    num_accepted: list[int]  # per row, 0 .. num_draft[row]
    logprobs: list[list[TokenLogprobs]] | None = None  # per row and token, the target's (infer.logprobs)


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
    packed = verify_tensors(to_device(draft_tokens, device).to(torch.long), tensor_on(list(num_draft), device,
                                                                                        torch.long),
                            None if draft_probs is None else to_device(draft_probs, device), target_probs,
                            to_device(accept_uniforms, device).to(torch.float64), sample_uniforms)
    return unpack_rows(packed.tolist())  # the one host sync


def verify_tensors(draft_tokens: torch.Tensor, counts: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                   sample_uniforms: torch.Tensor) -> torch.Tensor:
    """`verify` on the device, unchecked and without a host sync (a CUDA graph can hold it).

    draft_tokens [B, K] long, counts [B] long, draft_probs [B, K, V] or None, target_probs
    [B, K+1, V], accept_uniforms [B, K] float64, sample_uniforms [B] -> [B, K+2] long per row:
    the draft tokens (padding zeroed), the number accepted, the recovered or bonus token.
    """
    device = target_probs.device
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=device)[None, :] < counts[:, None]  # [B, K]
    tokens = torch.where(valid, draft_tokens, 0)  # [B, K]
    ratio = _token_ratios(target_probs[:, :k], draft_probs, tokens)  # [B, K]
    accepted = (accept_uniforms < ratio) & valid  # [B, K]
    num_accepted = accepted.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]: accepted prefix length
    rejected = num_accepted < counts  # [B]
    final = _final_distribution(target_probs, draft_probs, tokens, num_accepted, rejected)  # [B, V]
    extra = sample_from_probs(final, sample_uniforms)  # [B]
    return torch.cat([tokens, num_accepted[:, None], extra[:, None]], dim=1)


def verify_logits(target_logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                  draft_tokens: torch.Tensor, counts: torch.Tensor, draft_probs: torch.Tensor | None,
                  uniforms: torch.Tensor) -> torch.Tensor:
    """`verify_tensors` from raw target logits, for rows whose only sampling transform is a
    temperature (or greedy): target_logits [B, W, V] (W = K + 1), temperatures [B] float32
    (1.0 for greedy rows), greedy [B] bool, uniforms [B, W] float64 (K to accept, 1 to sample)
    -> [B, K+2] long. Greedy rows get one-hot targets, so they accept exactly the drafts that
    equal the argmax and then emit the argmax; all-greedy batches may pass zeros as uniforms."""
    b, w, vocab = target_logits.shape
    per_position = (temperatures[:, None].expand(b, w).reshape(-1),  # [B * W]
                    greedy[:, None].expand(b, w).reshape(-1))
    probs = temperature_probs(target_logits.reshape(b * w, vocab), *per_position).view(b, w, vocab)  # [B, W, V]
    return verify_tensors(draft_tokens, counts, draft_probs, probs, uniforms[:, :w - 1], uniforms[:, w - 1])


def verify_greedy_logits(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                         counts: torch.Tensor) -> torch.Tensor:
    """`verify_logits` for a batch of greedy rows, without the sampling machinery: keep drafts
    while they equal the argmax, then emit the argmax. target_logits [B, K+1, V], draft_tokens
    [B, K] long, counts [B] long -> [B, K+2] long (the same rows as `verify_logits`)."""
    k = target_logits.shape[1] - 1
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    valid = torch.arange(k, device=argmax.device)[None, :] < counts[:, None]  # [B, K]
    tokens = torch.where(valid, draft_tokens, 0)  # [B, K]
    num_accepted = ((tokens == argmax[:, :k]) & valid).to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]
    return torch.cat([tokens, num_accepted[:, None], argmax.gather(1, num_accepted[:, None])], dim=1)


def unpack_rows(rows: list[list[int]]) -> VerifyResult:
    """VerifyResult from `verify_tensors`' rows (on the host)."""
    num_accepted = [row[-2] for row in rows]
    return VerifyResult(tokens=[row[:n] + [row[-1]] for row, n in zip(rows, num_accepted, strict=True)],
                        num_accepted=num_accepted)
