"""Step costs of speculative decoding, measured through the engine's own forward functions.

c = draft step time / plain target step time (the paper's Definition 3.7) and v(K) = time to
verify K + 1 tokens / plain step time (`SpecCosts`). `measure_spec_costs` times the runner's
own forwards, `measure_model_costs` fresh ones for two models. docs/speculation.md, "Step costs".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds, Row, plan_batch
from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor import ForwardFn, ForwardSpec
from infer.engine.executor.factory import LOCAL
from infer.engine.executor.head_graphs import make_head_round
from infer.engine.executor.kernels import step_kernels
from infer.engine.parts import CacheConfig, ExecutionConfig
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import Kernels
from infer.models.llama import LlamaForCausalLM
from infer.models.medusa import MedusaHead
from infer.speculative.eagle_round import HeadRoundFn
from infer.timing import TimingStats, time_calls

Shape = tuple[int, bool]  # (tokens per row, logits of every token?)
PLAIN: Shape = (1, False)


@dataclass(frozen=True)
class StepCostConfig:
    context_len: int = 256  # tokens already cached when the step runs (W1's middle)
    max_seq_len: int = 512  # pool size (fresh pools); also the CUDA graphs' context width
    k_max: int = 8
    repeats: int = 30
    warmup: int = 10
    kv_cache_backend: str = "paged"

    def __post_init__(self) -> None:
        if self.context_len < 1 or self.k_max < 1 or self.repeats < 1:
            raise ValueError("StepCostConfig: context_len, k_max and repeats must be >= 1")
        if self.context_len + self.k_max + 1 > self.max_seq_len:
            raise ValueError(f"StepCostConfig: context_len + k_max + 1 = {self.context_len + self.k_max + 1} "
                             f"exceeds max_seq_len {self.max_seq_len}: raise max_seq_len")


@dataclass(frozen=True)
class SpecCosts:
    use_cuda_graphs: bool
    target_step_s: float
    draft_step_s: float | None
    c: float | None
    verify_s: list[float]  # [k_max + 1]: time to verify K+1 tokens, K = 0..k_max
    verify_ratio: list[float]  # verify_s[K] / target_step_s (v(0) = the all-logits one-token step)
    draft_fixed_s: float | None = None  # a round-drafting draft's fixed part a round (docs/speculation.md)

    def to_dict(self) -> dict[str, object]:
        return {"use_cuda_graphs": self.use_cuda_graphs, "target_step_ms": self.target_step_s * 1e3,
                "draft_step_ms": _ms(self.draft_step_s), "draft_round_fixed_ms": _ms(self.draft_fixed_s),
                "c": self.c, "verify_ms": [v * 1e3 for v in self.verify_s], "verify_ratio": self.verify_ratio}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights: its parameters (a tied embedding once) and persistent buffers
    (FP8 weights and scales)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for m in model.modules() for name, b in m._buffers.items()
                  if b is not None and name not in m._non_persistent_buffers_set)
    return params + buffers


def forward_times(forward: DraftStepFn, pool: CachePoolProtocol, shapes: list[Shape], vocab: int,
                  cfg: StepCostConfig, device: torch.device) -> dict[Shape, TimingStats]:
    """Median time of one batch-1 call of `forward` for each (width, all_logits) shape, on a
    scratch slot holding `cfg.context_len` tokens (freed afterwards)."""
    slot = pool.allocate_slot(cfg.context_len)
    try:
        if not pool.ensure_capacity(slot, cfg.context_len + max(w for w, _ in shapes)):
            raise RuntimeError("the KV pool has no room for the cost measurement's scratch slot")
        return {shape: time_calls(_step(forward, slot, shape, vocab, cfg.context_len), device, cfg.repeats,
                                  cfg.warmup) for shape in shapes}
    finally:
        pool.free_slot(slot)


def _step(forward: DraftStepFn, slot: int, shape: Shape, vocab: int, context_len: int) -> Callable[[], object]:
    width, all_logits = shape
    ids = torch.randint(0, vocab, (width,)).tolist()

    def run() -> torch.Tensor:  # (laid out every call, as the runner does)
        return forward.run(plan_batch([Row(slot, context_len, ids, width if all_logits else 1)]))

    return torch.inference_mode()(run)


def measure_spec_costs(target: ForwardFn, target_pool: CachePoolProtocol, draft: DraftStepFn | None,
                       draft_pool: CachePoolProtocol | None, vocab: int, cfg: StepCostConfig,
                       use_cuda_graphs: bool = True) -> SpecCosts:
    """c (when a draft is given) and v(K) for K = 0..cfg.k_max at batch 1."""
    device = target_pool.k_cache.device
    verify_shapes = [(k + 1, True) for k in range(cfg.k_max + 1)]
    times = forward_times(target, target_pool, [PLAIN, *verify_shapes], vocab, cfg, device)
    verify_s = [times[shape].median_s for shape in verify_shapes]
    draft_s = fixed_s = None
    if isinstance(draft, (RoundStepFn, MedusaStepFn)) and draft_pool is not None:
        draft_s, fixed_s = round_step_times(draft, draft_pool, vocab, cfg, device)
    elif draft is not None and draft_pool is not None:
        draft_s = forward_times(draft, draft_pool, [PLAIN], vocab, cfg, device)[PLAIN].median_s
    # measured again last: the smaller median guards against a slow start (clocks, lazy init)
    again = forward_times(target, target_pool, [PLAIN], vocab, cfg, device)[PLAIN].median_s
    plain = min(times[PLAIN].median_s, again)
    return SpecCosts(use_cuda_graphs, plain, draft_s, None if draft_s is None else draft_s / plain,
                     verify_s, [v / plain for v in verify_s], fixed_s)


def round_step_times(rounds: RoundStepFn | MedusaStepFn, pool: CachePoolProtocol, vocab: int, cfg: StepCostConfig,
                     device: torch.device) -> tuple[float, float]:
    """(step, fixed) seconds of a round-drafting draft: the slope of its rounds and the rest of a
    one-step round, both floored at 0. Medusa rounds are at most their number of heads long."""
    steps = max(2, cfg.k_max) if isinstance(rounds, RoundStepFn) else min(max(2, cfg.k_max), rounds.max_steps)
    if steps < 2:
        return forward_times(rounds, pool, [PLAIN], vocab, cfg, device)[PLAIN].median_s, 0.0
    times = forward_times(rounds, pool, [PLAIN, (steps, False)], vocab, cfg, device)
    one, many = times[PLAIN].median_s, times[(steps, False)].median_s
    step = max(0.0, (many - one) / (steps - 1))
    return step, max(0.0, one - step)


def _fresh_pool(model: LlamaForCausalLM | EagleHead, use_cuda_graphs: bool,
                cfg: StepCostConfig) -> tuple[CachePoolProtocol, Kernels]:
    """A pool of one sequence of `cfg.max_seq_len` tokens for `model`, and its kernels."""
    cache = CacheConfig(cfg.kv_cache_backend, 1, cfg.max_seq_len)
    pool = LOCAL.make_pool(model, cache, prefix_caching=False)
    device = next(model.parameters()).device
    return pool, step_kernels(_execution(use_cuda_graphs), device, model)


def _execution(use_cuda_graphs: bool) -> ExecutionConfig:
    """How the engine's steps run with or without CUDA graphs (the fused kernels with them)."""
    return ExecutionConfig(use_cuda_graphs, compile_kernels=use_cuda_graphs)


def _fresh_forward(model: LlamaForCausalLM, shapes: list[Shape], use_cuda_graphs: bool,
                   cfg: StepCostConfig) -> tuple[ForwardFn, CachePoolProtocol]:
    pool, kernels = _fresh_pool(model, use_cuda_graphs, cfg)
    tokens = max(w for w, _ in shapes)
    return LOCAL.make_forward(model, pool, ForwardSpec(use_cuda_graphs, 1, kernels, tokens=tokens)), pool


def measure_model_costs(target: LlamaForCausalLM, draft: LlamaForCausalLM | None, use_cuda_graphs: bool,
                        cfg: StepCostConfig | None = None, head: EagleHead | MedusaHead | None = None) -> SpecCosts:
    """`measure_spec_costs` on fresh pools and forward functions of the two models (an EAGLE
    `head` or Medusa heads in place of a draft model)."""
    cfg = cfg or StepCostConfig()
    shapes = [PLAIN, *[(k + 1, True) for k in range(cfg.k_max + 1)]]
    target_fn, target_pool = _fresh_forward(target, shapes, use_cuda_graphs, cfg)
    draft_fn: DraftStepFn | None = None
    draft_pool = None
    if isinstance(head, MedusaHead):  # (no cache: the target's pool lends the timed calls a scratch slot)
        kernels = step_kernels(_execution(use_cuda_graphs), target_pool.k_cache.device, head)
        draft_fn, draft_pool = MedusaStepFn(head, target.model.norm.weight.dtype, kernels), target_pool
    elif head is not None:
        draft_fn, draft_pool = head_forward(head, use_cuda_graphs, cfg)
    elif draft is not None:
        draft_fn, draft_pool = _fresh_forward(draft, [PLAIN], use_cuda_graphs, cfg)
    return measure_spec_costs(target_fn, target_pool, draft_fn, draft_pool, target.config.vocab_size, cfg,
                              use_cuda_graphs)


class RoundStepFn:
    """An EAGLE head's greedy chain round of one fed position and S steps (S = the one row's
    token count) as a forward function: `run(plan)` -> tokens [1, S]."""

    def __init__(self, round_fn: HeadRoundFn, head: EagleHead) -> None:
        self.round_fn = round_fn
        param = next(head.parameters())
        self.features = torch.zeros((1, head.spec.hidden_size), dtype=param.dtype, device=param.device)

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        if plan.num_rows != 1:
            raise ValueError(f"a timed round has one row, got {plan.num_rows}")
        (slot, end), steps = plan.ends[0], plan.query_lens[0]
        feed = plan_batch([Row(slot, end - steps, plan.arrays["ids"][:1].tolist())])  # the fed position
        return self.round_fn(feed, self.features, steps, [1.0], torch.zeros((1, steps), dtype=torch.float64),
                             [True])[0]


def head_forward(head: EagleHead, use_cuda_graphs: bool, cfg: StepCostConfig) -> tuple[RoundStepFn, CachePoolProtocol]:
    """A fresh pool and round step function of `head` (graphs captured now when asked for)."""
    pool, kernels = _fresh_pool(head, use_cuda_graphs, cfg)
    round_fn = make_head_round(head, pool, use_cuda_graphs, 1, 1, kernels)
    round_fn.prepare([1], [1, max(2, cfg.k_max)])
    return RoundStepFn(round_fn, head), pool


class MedusaStepFn:
    """A round of the first S Medusa heads (S = the one row's token count), top-1 each, as a
    forward function: `run(plan)` -> tokens [1, S]. The heads keep no cache."""

    def __init__(self, head: MedusaHead, dtype: torch.dtype, kernels: Kernels) -> None:
        self.head, self.kernels = head, kernels
        device = next(head.parameters()).device
        gen = torch.Generator(device=device).manual_seed(0)
        self.hidden = torch.randn((1, head.spec.hidden_size or 1), generator=gen, device=device).to(dtype)  # [1, H]

    @property
    def max_steps(self) -> int:
        return self.head.spec.num_heads

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        if plan.num_rows != 1:
            raise ValueError(f"a timed round has one row, got {plan.num_rows}")
        return self.head.top_tokens(self.hidden, [1] * plan.query_lens[0], self.kernels)


DraftStepFn = ForwardFn | RoundStepFn | MedusaStepFn  # a draft's timed call (a pass, or a round of heads)
