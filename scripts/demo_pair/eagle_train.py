"""Training of the demo EAGLE-3 head on the frozen demo target's features.

The head (`infer.models.eagle.EagleHead`, the engine's own forward) is trained with the
EAGLE recipe on cached teacher features (`demo_pair.eagle_data`):
- classification: cross-entropy of the head's draft-vocabulary distribution q against the
  target's next-token distribution p, restricted to the draft vocabulary and renormalised
  (the q that maximises sum_x min(p, q) when q can only cover the draft vocabulary);
- feature regression (EAGLE): smooth L1 between the head's output x_i and the feature the
  next position would get from the target, fc(f_{i+1}) (EAGLE-3's features go through fc;
  the regression target is detached), weighted by `feature_weight`;
- training-time test (EAGLE-3): `unroll` passes, pass j feeding the head its own outputs of
  pass j - 1 as draft step j + 1 does (`demo_pair.unrolled_view`); pass j's loss is
  weighted by `step_decay ** j`.
AdamW with warm-up and cosine decay (`demo_pair.trainer`'s optimiser and schedule), seeded
batches, float32 on the CPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from demo_pair.eagle_data import HeadData
from demo_pair.metrics import acceptance_alpha
from demo_pair.presets import TrainSettings
from demo_pair.trainer import build_optimizer, lr_factor
from demo_pair.unrolled_view import UnrolledView
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER
from infer.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class HeadSettings:
    """What the head is and what it is trained on; `train` holds the optimisation settings."""

    train: TrainSettings
    draft_vocab_size: int = 2048
    seq_len: int = 256  # window of target features a training sequence holds
    num_sequences: int = 192  # training windows of the corpus (the target runs once over each)
    greedy_sequences: int = 0  # more training windows: the target's greedy continuations of corpus prompts
    sampled_sequences: int = 0  # more: the target's continuations of corpus prompts sampled at T=1
    greedy_prompt: int = 32  # corpus tokens a generated window starts with (the rest is the target's)
    aux_layers: tuple[int, ...] | None = None  # the target layers whose inputs the head reads (None: EAGLE-3's)
    valid_sequences: int = 16  # validation windows, from the validation split
    unroll: int = 3  # training-time test passes (1: the target's features only)
    step_decay: float = 0.8  # weight of pass j's loss: step_decay ** j
    feature_weight: float = 0.1  # smooth L1 feature regression beside the cross-entropy

    def __post_init__(self) -> None:
        if self.draft_vocab_size <= 0 or self.seq_len < 8 or self.num_sequences <= 0 or self.valid_sequences <= 0:
            raise ValueError("HeadSettings: draft_vocab_size, num_sequences and valid_sequences must be > 0 "
                             f"and seq_len >= 8, got {self}")
        if min(self.greedy_sequences, self.sampled_sequences) < 0 or not 1 <= self.greedy_prompt < self.seq_len:
            raise ValueError("HeadSettings: greedy_sequences and sampled_sequences must be >= 0 and greedy_prompt "
                             f"in 1..seq_len - 1, got {self.greedy_sequences}, {self.sampled_sequences}, "
                             f"{self.greedy_prompt}")
        if self.aux_layers is not None and (len(self.aux_layers) != 3 or min(self.aux_layers) < 0):
            raise ValueError(f"HeadSettings: aux_layers names 3 target layers (>= 0), got {self.aux_layers}")
        if not 1 <= self.unroll <= 8:
            raise ValueError(f"HeadSettings: unroll must be in 1..8 passes, got {self.unroll}")
        if not 0.0 < self.step_decay <= 1.0 or self.feature_weight < 0:
            raise ValueError("HeadSettings: step_decay must be in (0, 1] and feature_weight >= 0")


@dataclass
class HeadLog:
    """Loss history of one head's training (written to the head's training summary)."""

    total_steps: int
    train: list[dict[str, float]] = field(default_factory=list)
    valid: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def init_head(head: EagleHead, seed: int, std: float = 0.02) -> None:
    """N(0, std) matrices (output projections scaled by 1/sqrt(2)), norms 1; deterministic."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                s = std / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)


def draft_logits(head: EagleHead, x: torch.Tensor) -> torch.Tensor:
    """Outputs [..., H] -> logits over the draft vocabulary [..., D] (float32)."""
    return EAGER.linear(head.lm_head, EAGER.rmsnorm(x, head.norm.weight, head.norm.eps), None).float()


def target_log_probs(target: LlamaForCausalLM, final: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's next-token log-probabilities over the draft vocabulary, renormalised:
    final [..., H] (its normed hidden states) -> [..., D]."""
    with torch.no_grad():
        logits = final @ target.lm_head.weight[draft_ids].T  # [..., D]
        return F.log_softmax(logits.float(), dim=-1)


def unrolled_losses(head: EagleHead, target: LlamaForCausalLM, ids: torch.Tensor, aux: torch.Tensor,
                    final: torch.Tensor, draft_ids: torch.Tensor, s: HeadSettings,
                    passes: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """ids [B, S], aux [B, S, 3H], final [B, S, H] -> (loss, per pass {ce, feature, alpha, agree}).
    Position i of pass j predicts token i + 2 (the target's distribution at i + 1)."""
    b, seq = ids.shape
    positions = torch.arange(seq).expand(b, seq)  # [B, S]
    features = head.combine(aux)  # [B, S, H]
    log_p = target_log_probs(target, final[:, 1:], draft_ids)  # [B, S - 1, D] for positions 0..S-2
    goal = features[:, 1:].detach()  # [B, S - 1, H]
    tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # [B, S]: t_{i+1} (the last is never scored)
    view = UnrolledView()
    loss = torch.zeros(())
    parts = []
    inputs = features
    for j in range(passes):
        x = head(tokens, inputs, positions, view)  # [B, S, H]
        log_q = F.log_softmax(draft_logits(head, x[:, j:-1]), dim=-1)  # [B, S - 1 - j, D]
        lp = log_p[:, j:]
        ce = -(lp.exp() * log_q).sum(-1).mean()
        feature = F.smooth_l1_loss(x[:, j:-1], goal[:, j:])
        loss = loss + s.step_decay ** j * (ce + s.feature_weight * feature)
        with torch.no_grad():
            alpha = acceptance_alpha(lp.exp(), log_q.exp()).mean()
            agree = (lp.argmax(-1) == log_q.argmax(-1)).float().mean()
        parts.append({"ce": ce.detach(), "feature": feature.detach(), "alpha": alpha, "agree": agree})
        inputs = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # x_{i-1} at position i
    return loss, parts


@torch.no_grad()
def validate_head(head: EagleHead, target: LlamaForCausalLM, data: HeadData, draft_ids: torch.Tensor,
                  s: HeadSettings) -> dict[str, float]:
    """Teacher-forced alpha (T=1) and greedy agreement of each draft step on `data`. Both are
    against the target's distribution over the draft vocabulary, renormalised."""
    head.eval()
    sums: dict[str, float] = {}
    n = len(data)
    for i in range(0, n, s.train.batch_size):
        ids, aux, final = data.batch(torch.arange(i, min(i + s.train.batch_size, n)))
        _, parts = unrolled_losses(head, target, ids, aux, final, draft_ids, s, s.unroll)
        weight = ids.shape[0] / n
        for j, p in enumerate(parts):
            for key in ("ce", "alpha", "agree"):
                sums[f"{key}{j + 1}"] = sums.get(f"{key}{j + 1}", 0.0) + float(p[key]) * weight
    head.train()
    return sums


def train_head(head: EagleHead, target: LlamaForCausalLM, data: HeadData, valid: dict[str, HeadData],
               draft_ids: torch.Tensor, s: HeadSettings, seed: int,
               log: Callable[[str], None] = print,
               checkpoint: Callable[[HeadLog], None] | None = None) -> HeadLog:
    """Train `head` in place (the target stays frozen); returns the loss history. `valid`
    names the validation sets by the prefix of their keys in the log ("" for the corpus's);
    `checkpoint` is called after each validation (e.g. to save the head so far)."""
    t = s.train
    total = t.total_steps(len(data))
    history = HeadLog(total_steps=total)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    opt = build_optimizer(head, t, torch.device("cpu"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(total, t.warmup_steps, t.min_lr_ratio))
    head.train()
    start = time.perf_counter()
    order = torch.randperm(len(data), generator=gen)
    at = 0
    for step in range(1, total + 1):
        if at + t.batch_size > len(data):
            order, at = torch.randperm(len(data), generator=gen), 0
        ids, aux, final = data.batch(order[at:at + t.batch_size])
        at += t.batch_size
        loss, parts = unrolled_losses(head, target, ids, aux, final, draft_ids, s, s.unroll)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 10 == 0 or step == total:
            row = {"step": step, "loss": float(loss.detach()), **{f"{k}{j + 1}": float(v) for j, p in enumerate(parts)
                                                          for k, v in p.items()}}
            history.train.append(row)
            log(f"[eagle3] step {step}/{total} " + " ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step")
                + f" ({time.perf_counter() - start:.0f} s)")
        if step % t.eval_every == 0 or step == total:
            row = {"step": step}
            for prefix, v in valid.items():
                row.update({prefix + k: x for k, x in validate_head(head, target, v, draft_ids, s).items()})
            history.valid.append(row)
            log("[eagle3] valid " + " ".join(f"{k} {v:.3f}" for k, v in row.items()))
            if checkpoint is not None and step < total:
                checkpoint(history)
    head.eval()
    history.seconds = time.perf_counter() - start
    return history
