"""Speculative-decoding quality of a draft against a target, and n-gram baselines.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding":
- Theorem 3.5 / Corollary 3.6: a draft token sampled from q is accepted with probability
  beta = sum_x min(p(x), q(x)); alpha = E[beta] over positions (temperature 1).
- At temperature 0 (argmax) acceptance is P(argmax p = argmax q): the greedy agreement.
- Equation (1) and Theorem 3.8 (expected tokens per target call, walltime factor): the
  formulas of `infer.speculative.theory`, re-exported here.
The unigram and bigram baselines of Table 3 are fitted here on a token stream with add-k
smoothing. Everything is a pure function of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.speculative.theory import expected_tokens, walltime_factor

__all__ = ["acceptance_alpha", "greedy_agreement", "fit_unigram", "fit_bigram", "expected_tokens",
           "walltime_factor", "PairTotals"]


def acceptance_alpha(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q: [..., V] distributions -> [...] sum_x min(p(x), q(x))."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def greedy_agreement(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q: [..., V] scores or probabilities -> [...] bool, argmax p == argmax q."""
    return p.argmax(-1) == q.argmax(-1)


def fit_unigram(stream: torch.Tensor, vocab_size: int, k: float) -> torch.Tensor:
    """stream [N] -> [V] add-k smoothed token frequencies."""
    if k <= 0:
        raise ValueError(f"smoothing k must be > 0, got {k}")
    counts = torch.bincount(stream, minlength=vocab_size).double()  # [V]
    return ((counts + k) / (counts.sum() + k * vocab_size)).float()


def fit_bigram(stream: torch.Tensor, vocab_size: int, k: float) -> torch.Tensor:
    """stream [N] -> [V, V] add-k smoothed P(next | previous); row = previous token."""
    if k <= 0:
        raise ValueError(f"smoothing k must be > 0, got {k}")
    if stream.numel() and int(stream.max()) >= vocab_size:
        raise ValueError(f"stream has token id {int(stream.max())} >= vocab_size {vocab_size}")
    pairs = stream[:-1] * vocab_size + stream[1:]  # [N - 1]
    counts = torch.bincount(pairs, minlength=vocab_size * vocab_size).view(vocab_size, vocab_size)
    counts = counts.float()
    return (counts + k) / (counts.sum(-1, keepdim=True) + k * vocab_size)  # [V, V]


@dataclass
class PairTotals:
    """Running sums over teacher-forced positions for one (target, draft) comparison."""

    positions: int = 0
    target_nll: float = 0.0
    draft_nll: float = 0.0
    alpha: float = 0.0
    agree: int = 0

    def add(self, p_logp: torch.Tensor, q_logp: torch.Tensor, labels: torch.Tensor) -> None:
        """p_logp, q_logp: [N, V] log-probabilities of target / draft; labels: [N]."""
        p, q = p_logp.exp(), q_logp.exp()
        self.positions += labels.numel()
        self.target_nll -= float(p_logp.gather(-1, labels[:, None]).sum())
        self.draft_nll -= float(q_logp.gather(-1, labels[:, None]).sum())
        self.alpha += float(acceptance_alpha(p, q).sum())
        self.agree += int(greedy_agreement(p_logp, q_logp).sum())

    def summary(self) -> dict[str, float]:
        n = max(self.positions, 1)
        return {"positions": self.positions, "target_loss": self.target_nll / n,
                "draft_loss": self.draft_nll / n, "alpha": self.alpha / n,
                "greedy_agreement": self.agree / n}
