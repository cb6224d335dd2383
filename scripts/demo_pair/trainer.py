"""Training loop of the demo models, on infer's own `LlamaForCausalLM` forward.

Each step runs the model with explicit positions and a `NoCacheView` (causal attention
within the batch, no KV cache), so the trained weights are exactly what the engine runs.
AdamW with decoupled weight decay on matrices only, linear warm-up then cosine decay,
gradient clipping, bf16 autocast on CUDA (fp32 master weights), residual dropout added
with forward hooks during training only.

Two objectives: next-token cross-entropy (the target), and distillation (the draft): the
forward KL(p_teacher || q_student) at temperature 1, optionally mixed with cross-entropy.
The paper's acceptance rate alpha = E[sum_x min(p, q)] = 1 - E[TV(p, q)] is highest when
q matches p, and KL bounds TV (Pinsker), so the draft learns the target's distribution
rather than the data's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from demo_pair.data import batch_chunks, num_sequences, training_batches
from demo_pair.metrics import PairTotals
from demo_pair.presets import TrainSettings
from infer.models.layers.attention import NoCacheView
from infer.models.layers.norms import RMSNorm
from infer.models.llama import LlamaForCausalLM

LOG_EVERY = 10
EVAL_BATCH = 16


@dataclass
class TrainLog:
    """What happened during one model's training (written to JSON)."""

    role: str
    total_steps: int
    settings: dict[str, Any]
    tokens_seen: int = 0
    seconds: float = 0.0
    train: list[dict[str, float]] = field(default_factory=list)  # step, loss, lr (, kl, ce)
    valid: list[dict[str, float]] = field(default_factory=list)  # step, loss (, kl, alpha)
    selected_step: int = 0  # the step whose weights were kept
    selected_by: str = ""  # the validation metric that chose it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def init_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) matrices and embeddings, output projections scaled by
    1/sqrt(2 * layers), RMSNorm weights 1. Deterministic for a seed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scaled = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            s = scaled if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            param.copy_(torch.randn(param.shape, generator=gen) * s)


def dropout_sites(model: LlamaForCausalLM) -> list[nn.Module]:
    """The last projection of each attention and MLP block: its output joins the residual."""
    sites: list[nn.Module] = []
    for layer in model.model.layers:
        sites += [layer.self_attn.o_proj, layer.mlp.down_proj]
    return sites


def add_residual_dropout(model: LlamaForCausalLM, p: float) -> list[Any]:
    """Dropout on each attention / MLP output while model.training; returns hook handles."""
    if p <= 0:
        return []

    def hook(module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, p, module.training)

    return [site.register_forward_hook(hook) for site in dropout_sites(model)]


def build_optimizer(model: nn.Module, s: TrainSettings, device: torch.device) -> torch.optim.AdamW:
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    params = list(model.parameters())  # tied weights appear once
    decay = [p for p in params if id(p) not in norms]
    no_decay = [p for p in params if id(p) in norms]
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=device.type == "cuda")


def lr_factor(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr at step i (0-based): linear warm-up, cosine to min_ratio."""
    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = (i - warmup) / max(total - warmup, 1)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_logits(model: LlamaForCausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """inputs [B, T] -> logits [B, T, V] (float32), causal attention, positions 0..T-1."""
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)  # [B, T]
    return model(inputs, positions, NoCacheView()).float()


def distill_losses(student: torch.Tensor, teacher: torch.Tensor,
                   labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """student, teacher: logits [N, V]; labels [N] -> (mean KL(p_t || q_s), mean CE of q_s)."""
    log_q = F.log_softmax(student, dim=-1)  # [N, V]
    log_p = F.log_softmax(teacher, dim=-1)  # [N, V]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ce = F.nll_loss(log_q, labels)
    return kl, ce


def step_loss(model: LlamaForCausalLM, batch: torch.Tensor, s: TrainSettings,
              teacher: LlamaForCausalLM | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """batch [B, T + 1] -> (loss to minimise, detached parts)."""
    inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
    logits = forward_logits(model, inputs).flatten(0, 1)  # [B * T, V]
    if teacher is None or s.distill_weight == 0:
        ce = F.cross_entropy(logits, labels)
        return ce, {"loss": ce.detach()}
    with torch.no_grad():
        t_logits = forward_logits(teacher, inputs).flatten(0, 1)  # [B * T, V]
    kl, ce = distill_losses(logits, t_logits, labels)
    loss = s.distill_weight * kl + (1.0 - s.distill_weight) * ce
    return loss, {"loss": loss.detach(), "kl": kl.detach(), "ce": ce.detach()}


@torch.no_grad()
def validate(model: LlamaForCausalLM, chunks: list[torch.Tensor], device: torch.device,
             teacher: LlamaForCausalLM | None = None) -> dict[str, float]:
    """Mean next-token loss on the chunks; with a teacher also KL and alpha against it."""
    was_training = model.training
    model.eval()
    totals = PairTotals()
    kl_sum = 0.0
    for batch in batch_chunks(chunks, EVAL_BATCH):
        batch = batch.to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
        with autocast(device):
            log_q = F.log_softmax(forward_logits(model, inputs).flatten(0, 1), dim=-1)
            ref = teacher if teacher is not None else model
            log_p = log_q if teacher is None else F.log_softmax(
                forward_logits(ref, inputs).flatten(0, 1), dim=-1)
        totals.add(log_p, log_q, labels)
        kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
    model.train(was_training)
    summary = totals.summary()
    out = {"loss": summary["draft_loss"]}
    if teacher is not None:
        out.update(kl=kl_sum / max(totals.positions, 1), alpha=summary["alpha"],
                   greedy_agreement=summary["greedy_agreement"])
    return out


def train_model(model: LlamaForCausalLM, train_stream: torch.Tensor, valid: list[torch.Tensor],
                s: TrainSettings, *, device: torch.device, seed: int, role: str,
                teacher: LlamaForCausalLM | None = None,
                log: Callable[[str], None] = print) -> TrainLog:
    """Train `model` in place on `train_stream` [N]; returns the loss history."""
    seq_len = model.config.max_position_embeddings
    total = s.total_steps(num_sequences(train_stream.numel(), seq_len))
    torch.manual_seed(seed)
    batches = training_batches(train_stream, seq_len, s.batch_size,
                               torch.Generator().manual_seed(seed + 1))
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    hooks = add_residual_dropout(model, s.dropout)
    opt = build_optimizer(model, s, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(total, s.warmup_steps, s.min_lr_ratio))
    history = TrainLog(role=role, total_steps=total, settings=asdict(s))
    model.train()
    start = time.perf_counter()
    try:
        best = _loop(model, batches, opt, sched, s, total, device, teacher, valid, history, log)
    finally:
        for handle in hooks:
            handle.remove()
    model.eval()
    if s.select == "best" and best is not None:
        model.load_state_dict(best)
    else:
        history.selected_step = total
    log(f"[{role}] keeping the weights of step {history.selected_step} ({s.select})")
    history.seconds = time.perf_counter() - start
    history.tokens_seen = total * s.batch_size * seq_len
    return history


def _loop(model: LlamaForCausalLM, batches: Iterator[torch.Tensor], opt: torch.optim.Optimizer,
          sched: torch.optim.lr_scheduler.LRScheduler, s: TrainSettings, total: int,
          device: torch.device, teacher: LlamaForCausalLM | None, valid: list[torch.Tensor],
          history: TrainLog, log: Callable[[str], None]) -> dict[str, torch.Tensor] | None:
    """Runs the steps; returns a copy of the best validated weights (None if never validated)."""
    metric = "kl" if teacher is not None and s.distill_weight > 0 else "loss"
    history.selected_by = f"validation {metric}"
    best: dict[str, torch.Tensor] | None = None
    best_value = math.inf
    sums: dict[str, torch.Tensor] = {}
    count = 0
    t0 = time.perf_counter()
    for step in range(1, total + 1):
        batch = next(batches).to(device, non_blocking=True)
        with autocast(device):
            loss, parts = step_loss(model, batch, s, teacher)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        sched.step()
        for key, value in parts.items():
            sums[key] = sums.get(key, torch.zeros((), device=device)) + value
        count += 1
        if step % LOG_EVERY == 0 or step == total:
            row = {"step": step, "lr": lr, **{k: float(v) / count for k, v in sums.items()}}
            history.train.append(row)
            rate = count * batch.numel() / (time.perf_counter() - t0)
            log(f"[{history.role}] step {step}/{total} " + _fmt(row) + f" tok/s {rate:,.0f}")
            sums, count, t0 = {}, 0, time.perf_counter()
        if step % s.eval_every == 0 or step == total:
            row = {"step": step, **validate(model, valid, device, teacher)}
            history.valid.append(row)
            log(f"[{history.role}] valid step {step} " + _fmt(row))
            if row[metric] < best_value:
                best_value, history.selected_step = row[metric], step
                best = {k: v.detach().clone() for k, v in model.state_dict().items()}
            t0 = time.perf_counter()
    return best


def _fmt(row: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4g}" for k, v in row.items() if k != "step")
