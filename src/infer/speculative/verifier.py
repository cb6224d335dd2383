"""The verifier: lossless acceptance of a chain or a tree of drafts, batched and pure.

Chains (`verify_tensors`, `verify_logits`, `verify_greedy_logits`): Leviathan et al. 2023, Algorithm 1. Trees, static
or dynamic through a `TreeFrame` (`verify_tree_nodes`, `verify_tree_logits`, `verify_tree_greedy`): iterative
speculative sampling. p and q are after the request's sampling transforms; q None is a one-hot proposal. Float64, no
host sync; packed rows out (`unpack_rows`). Rule, uniforms, losslessness: docs/speculation.md, "The verifier"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.logprobs import TokenLogprobs
from infer.sampling import greedy_tokens, sample_from_probs, temperature_probs
from infer.speculative.node_tree import TreeFrame, as_frame
from infer.speculative.tree import TreeShape
from infer.transfer import tensor_on, to_device

# A residual max(0, p - q) with less mass than this is rounding noise: the replacement is drawn from p.
MIN_RESIDUAL_MASS = 1e-12


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Per row: accepted draft tokens then exactly one recovered or bonus token."""

    tokens: list[list[int]]  # per row, num_accepted[row] + 1 token ids
    num_accepted: list[int]  # per row, 0 .. num_draft[row]
    logprobs: list[list[TokenLogprobs]] | None = None  # per row and token, the target's (infer.logprobs)


def _token_ratios(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """p(t) / q(t) in float64: p, q [..., V], tokens [...] -> [...]; q None = one-hot at t (0/0: NaN, rejects)."""
    p_tok = p.gather(-1, tokens[..., None]).squeeze(-1).to(torch.float64)  # [...]
    if q is None:
        return p_tok
    q_tok = q.gather(-1, tokens[..., None]).squeeze(-1).to(torch.float64)  # [...]
    return p_tok / q_tok


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
    """Rejection-sample a batch of drafts against the target (Algorithm 1), checked; one host sync.

    draft_tokens [B, K] long (row b uses its first num_draft[b]), draft_probs [B, K, V] or None,
    target_probs [B, K+1, V] (position k_b gives the bonus), accept_uniforms [B, K] and
    sample_uniforms [B] in [0, 1).
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

    counts [B] long, accept_uniforms float64, the rest as `verify` -> [B, K+2] long per row:
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
    """`verify_tensors` from raw target logits, for rows sampling with a temperature alone (or greedy):
    target_logits [B, K+1, V], temperatures [B] float32 (1.0 for greedy rows), greedy [B] bool,
    uniforms [B, K+1] float64 (K to accept, 1 to sample) -> [B, K+2] long. Greedy rows get one-hot
    targets; all-greedy batches may pass zeros as uniforms."""
    b, w, vocab = target_logits.shape
    per_position = (temperatures[:, None].expand(b, w).reshape(-1),  # [B * W]
                    greedy[:, None].expand(b, w).reshape(-1))
    probs = temperature_probs(target_logits.reshape(b * w, vocab), *per_position).view(b, w, vocab)  # [B, W, V]
    return verify_tensors(draft_tokens, counts, draft_probs, probs, uniforms[:, :w - 1], uniforms[:, w - 1])


def verify_greedy_logits(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                         counts: torch.Tensor) -> torch.Tensor:
    """`verify_logits` for all-greedy rows, without sampling: target_logits [B, K+1, V], draft_tokens
    [B, K] long, counts [B] long -> [B, K+2] long (the same rows as `verify_logits`)."""
    k = target_logits.shape[1] - 1
    argmax = greedy_tokens(target_logits)  # [B, K+1] (NO_TOKEN where a row is not finite)
    valid = torch.arange(k, device=argmax.device)[None, :] < counts[:, None]  # [B, K]
    tokens = torch.where(valid, draft_tokens, 0)  # [B, K]
    num_accepted = ((tokens == argmax[:, :k]) & valid).to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]
    return torch.cat([tokens, num_accepted[:, None], argmax.gather(1, num_accepted[:, None])], dim=1)


def unpack_rows(rows: list[list[int]]) -> VerifyResult:
    """VerifyResult from `verify_tensors`' rows (on the host)."""
    num_accepted = [row[-2] for row in rows]
    return VerifyResult(tokens=[row[:n] + [row[-1]] for row, n in zip(rows, num_accepted, strict=True)],
                        num_accepted=num_accepted)


# -- trees ----------------------------------------------------------------------
def _check_tree_inputs(shape: TreeShape | TreeFrame, node_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, uniforms: torch.Tensor, node_valid: torch.Tensor | None) -> None:
    n = shape.num_nodes
    if node_tokens.dim() != 2 or node_tokens.shape[1] != n:
        raise ValueError(f"node_tokens must be [batch, {n}] for tree {shape}, got shape {tuple(node_tokens.shape)}")
    b = node_tokens.shape[0]
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (b, n + 1):
        raise ValueError(f"target_probs must be [{b}, {n + 1}, vocab] (g then the {n} nodes), "
                         f"got shape {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (b, n, vocab):
        raise ValueError(f"draft_probs must be None or [{b}, {n}, {vocab}], got shape {tuple(draft_probs.shape)}")
    if tuple(uniforms.shape) != (b, shape.num_uniforms):
        raise ValueError(f"uniforms must be [{b}, {shape.num_uniforms}] (sum of the branching + 1 for tree "
                         f"{shape}), got shape {tuple(uniforms.shape)}")
    if node_valid is not None and tuple(node_valid.shape) != (b, n):
        raise ValueError(f"node_valid must be None or [{b}, {n}], got shape {tuple(node_valid.shape)}")


def _column(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, M] at one column per row: index [B] -> [B]."""
    return t.gather(1, index[:, None]).squeeze(1)


def _row_of(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [B, M, V] at one slot per row: index [B] -> [B, V]."""
    return t.gather(1, index[:, None, None].expand(-1, 1, t.shape[2])).squeeze(1)


def _present(node_tokens: torch.Tensor, node_valid: torch.Tensor | None, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [B, N] bool, tokens [B, N] long with 0 at absent nodes) on `device`."""
    valid = (torch.ones(node_tokens.shape, dtype=torch.bool, device=device) if node_valid is None
             else node_valid.to(device=device, dtype=torch.bool))
    return valid, torch.where(valid, node_tokens.to(device=device, dtype=torch.long), 0)


def _pack(path_tokens: list[torch.Tensor], path_nodes: list[torch.Tensor], final: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth accepted tokens (0 past the path) and nodes (-1), final [B] -> (packed, nodes)."""
    nodes = torch.stack(path_nodes, dim=1)  # [B, depth]
    num_accepted = (nodes >= 0).sum(dim=1)  # [B]
    return torch.cat([torch.stack(path_tokens, dim=1), num_accepted[:, None], final[:, None]], dim=1), nodes


def _test_sampled(p: torch.Tensor, q: torch.Tensor, tok: torch.Tensor, tried: torch.Tensor,
                  u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One child drawn from q: p, q [B, V], tok [B], tried [B] bool, u [B] -> (accepted [B], next p)."""
    ratio = _column(p, tok) / _column(q, tok).to(torch.float64)  # [B]; NaN (0/0) rejects
    accept = tried & (u < ratio)
    return accept, torch.where((tried & ~accept)[:, None], residual_distribution(p, q), p)


def _test_one_hot(p: torch.Tensor, scale: torch.Tensor, mass: torch.Tensor, tok: torch.Tensor,
                  tried: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One deterministic child (q one-hot at tok) in O(B): the distribution is p * scale (p [B, V]
    float64, owned, unnormalised; sum(p) * scale = mass [B]); a rejection drops tok from p in place
    (`residual_distribution` for a one-hot q, fallback included). -> (accepted, scale, mass)."""
    p_tok = _column(p, tok)  # [B]
    accept = tried & (u < p_tok * scale)
    reject = tried & ~accept
    rest = mass - p_tok * scale  # [B]: the residual's mass
    drop = reject & (rest > MIN_RESIDUAL_MASS)  # (else the fallback: p itself, renormalised)
    p.scatter_(1, tok[:, None], torch.where(drop, 0.0, p_tok)[:, None])
    scale = torch.where(drop, scale / rest, torch.where(reject, scale / mass, scale))
    return accept, scale, torch.where(reject, 1.0, mass)


def verify_tree_nodes(shape: TreeShape | TreeFrame, node_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      target_probs: torch.Tensor, uniforms: torch.Tensor,
                      node_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B trees (one static shape, or a `TreeFrame` of per-row trees) by iterative speculative sampling.

    node_tokens [B, N] long (any value at absent nodes), draft_probs [B, N, V] or None
    (deterministic proposals), target_probs [B, N+1, V] (row 0 after g, row 1 + i after node
    i), uniforms [B, U] in [0, 1), U = shape.num_uniforms, node_valid [B, N] bool or None (all
    present) -> (packed [B, depth + 2] long, accepted nodes [B, depth] long, -1 padded).
    """
    _check_tree_inputs(shape, node_tokens, draft_probs, target_probs, uniforms, node_valid)
    device = target_probs.device
    b = node_tokens.shape[0]
    frame = as_frame(shape, device)
    kids_of = frame.children.expand(b, -1, -1)  # [B, N+1, C]
    valid, tokens = _present(node_tokens, node_valid, device)  # [B, N], [B, N]
    u = uniforms.to(device=device, dtype=torch.float64)  # [B, U]
    p = target_probs[:, 0].to(torch.float64, copy=True)  # [B, V]: the current (residual) distribution
    scale = torch.ones(b, dtype=torch.float64, device=device)  # [B]: one-hot path, p * scale
    mass = p.sum(dim=1)  # [B]: one-hot path, sum(p) * scale
    slot = torch.zeros(b, dtype=torch.long, device=device)  # [B]: block row of the current node
    alive = torch.ones(b, dtype=torch.bool, device=device)  # [B]: accepted every level so far
    path_tokens: list[torch.Tensor] = []
    path_nodes: list[torch.Tensor] = []
    for d, width in enumerate(frame.widths):  # children at depth d + 1
        kids = _row_of(kids_of, slot)  # [B, C]: the current node's children, -1 padded
        moved = torch.zeros_like(alive)  # [B]
        chosen = torch.full_like(slot, -1)  # [B]
        for c in range(width):
            child = kids[:, c].clamp(min=0)  # [B]
            tok = _column(tokens, child)  # [B]
            tried = alive & ~moved & (kids[:, c] >= 0) & _column(valid, child)  # [B]
            u_c = u[:, frame.uniform_offsets[d] + c]  # [B]
            if draft_probs is None:
                accept, scale, mass = _test_one_hot(p, scale, mass, tok, tried, u_c)
            else:
                accept, p = _test_sampled(p, _row_of(draft_probs, child), tok, tried, u_c)
            chosen = torch.where(accept, child, chosen)
            moved = moved | accept
        safe = chosen.clamp(min=0)  # [B]
        at_child = _row_of(target_probs, 1 + safe).to(torch.float64)  # [B, V]
        p = torch.where(moved[:, None], at_child, p)
        if draft_probs is None:
            scale = torch.where(moved, 1.0, scale)
            mass = torch.where(moved, at_child.sum(dim=1), mass)
        slot = torch.where(moved, 1 + safe, slot)
        path_tokens.append(torch.where(moved, _column(tokens, safe), 0))
        path_nodes.append(chosen)
        alive = moved
    return _pack(path_tokens, path_nodes, sample_from_probs(p, u[:, -1]))  # (p need not be normalised)


def verify_tree_logits(shape: TreeShape | TreeFrame, target_logits: torch.Tensor, temperatures: torch.Tensor,
                       greedy: torch.Tensor, node_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       uniforms: torch.Tensor, node_valid: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_tree_nodes` from raw target logits [B, N+1, V], for temperature-only rows as in
    `verify_logits` (temperatures [B] float32, greedy [B] bool; uniforms [B, U] float64, zeros
    allowed for all-greedy batches) -> (packed [B, depth + 2] long, nodes [B, depth] long)."""
    b, w, vocab = target_logits.shape
    per_slot = (temperatures[:, None].expand(b, w).reshape(-1),  # [B * (N+1)]
                greedy[:, None].expand(b, w).reshape(-1))
    probs = temperature_probs(target_logits.reshape(b * w, vocab), *per_slot).view(b, w, vocab)  # [B, N+1, V]
    return verify_tree_nodes(shape, node_tokens, draft_probs, probs, uniforms, node_valid)


def verify_tree_greedy(shape: TreeShape | TreeFrame, target_scores: torch.Tensor, node_tokens: torch.Tensor,
                       node_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax walk (Stratos, Appendix A) for all-greedy batches: target_scores [B, N+1, V]
    (logits or probs), node_tokens [B, N] long, node_valid [B, N] bool or None -> the rows of
    `verify_tree_logits` with every row greedy."""
    b, n = node_tokens.shape
    if target_scores.dim() != 3 or tuple(target_scores.shape[:2]) != (b, n + 1) or n != shape.num_nodes:
        raise ValueError(f"node_tokens must be [batch, {shape.num_nodes}] and target_scores [batch, "
                         f"{shape.num_nodes + 1}, vocab] for tree {shape}, got {tuple(node_tokens.shape)} "
                         f"and {tuple(target_scores.shape)}")
    if node_valid is not None and tuple(node_valid.shape) != (b, n):
        raise ValueError(f"node_valid must be None or [{b}, {n}], got shape {tuple(node_valid.shape)}")
    device = target_scores.device
    frame = as_frame(shape, device)
    kids_of = frame.children.expand(b, -1, -1)  # [B, N+1, C]
    argmax = greedy_tokens(target_scores)  # [B, N+1] (NO_TOKEN where a row is not finite)
    valid, tokens = _present(node_tokens, node_valid, device)  # [B, N], [B, N]
    slot = torch.zeros(b, dtype=torch.long, device=device)  # [B]: block row of the current node
    alive = torch.ones(b, dtype=torch.bool, device=device)  # [B]
    path_tokens: list[torch.Tensor] = []
    path_nodes: list[torch.Tensor] = []
    for width in frame.widths:
        want = _column(argmax, slot)  # [B]
        kids = _row_of(kids_of, slot)  # [B, C]
        chosen = torch.full_like(slot, -1)  # [B]
        for c in range(width):
            child = kids[:, c].clamp(min=0)  # [B]
            match = (alive & (chosen < 0) & (kids[:, c] >= 0) & _column(valid, child)
                     & (_column(tokens, child) == want))
            chosen = torch.where(match, child, chosen)
        moved = chosen >= 0  # [B]
        safe = chosen.clamp(min=0)  # [B]
        slot = torch.where(moved, 1 + safe, slot)
        path_tokens.append(torch.where(moved, _column(tokens, safe), 0))
        path_nodes.append(chosen)
        alive = moved
    return _pack(path_tokens, path_nodes, _column(argmax, slot))
