"""Step costs of speculative decoding, measured through the engine's own forward functions.

c = draft step time / plain target step time (batch 1, one token, last-token logits), as the
paper's Definition 3.7, with and without CUDA graphs; v(K) = target time to verify K+1
tokens (all logits, as the speculative runner asks) / plain target step time, K = 1..k_max.
Each forward runs on a scratch slot of a fresh pool (`make_pool_for`, the runner's pools)
at a fixed context length, through `make_forward` with the engine's step kernels (eager, or
the CUDA graphs with fused kernels the engine would replay); the slot is freed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.bench.timing import TimingStats, time_calls
from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.forward import ForwardFn, make_forward
from infer.engine.runner import make_pool_for, step_kernels
from infer.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StepCostConfig:
    context_len: int = 256  # tokens already cached when the step runs (W1's middle)
    max_seq_len: int = 512  # pool size; also the CUDA graphs' context width
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


def _pool(model: LlamaForCausalLM, cfg: StepCostConfig) -> CachePoolProtocol:
    param = next(model.parameters())
    engine_cfg = EngineConfig(max_batch_size=1, max_seq_len=cfg.max_seq_len, kv_cache_backend=cfg.kv_cache_backend,
                              enable_prefix_caching=False)
    return make_pool_for(model.config, engine_cfg, param.dtype, param.device, prefix_caching=False)


Shape = tuple[int, bool]  # (tokens per row, logits of every token?)


def step_times(model: LlamaForCausalLM, shapes: list[Shape], use_cuda_graphs: bool,
               cfg: StepCostConfig) -> dict[Shape, TimingStats]:
    """Median time of one batch-1 forward of each (width, all_logits) shape."""
    pool = _pool(model, cfg)
    device = next(model.parameters()).device
    kernels = step_kernels(EngineConfig(use_cuda_graphs=use_cuda_graphs), device, model)  # as the engine runs them
    forward: ForwardFn = make_forward(model, pool, use_cuda_graphs, 1, shapes=list(shapes), kernels=kernels)
    slot = pool.allocate_slot(cfg.context_len)
    try:
        pool.ensure_capacity(slot, cfg.context_len + max(w for w, _ in shapes))
        return {shape: time_calls(_step(forward, slot, shape, model.config.vocab_size, cfg.context_len),
                                  device, cfg.repeats, cfg.warmup) for shape in shapes}
    finally:
        pool.free_slot(slot)
        del forward, pool


def _step(forward: ForwardFn, slot: int, shape: Shape, vocab: int, context_len: int) -> Callable[[], object]:
    width, all_logits = shape
    layout = BatchLayout.of([slot], [context_len], [width])
    ids = torch.randint(0, vocab, (1, width))  # [1, width], CPU as the runners pass them

    def run() -> torch.Tensor:
        return forward(ids, layout, all_logits=all_logits)

    return torch.inference_mode()(run)


@dataclass(frozen=True)
class SpecCosts:
    use_cuda_graphs: bool
    target_step_s: float
    draft_step_s: float | None
    c: float | None
    verify_s: list[float]  # [k_max + 1]: time to verify K+1 tokens, K = 0..k_max
    verify_ratio: list[float]  # verify_s[K] / target_step_s (v(0) = the all-logits one-token step)

    def to_dict(self) -> dict[str, object]:
        return {"use_cuda_graphs": self.use_cuda_graphs, "target_step_ms": self.target_step_s * 1e3,
                "draft_step_ms": None if self.draft_step_s is None else self.draft_step_s * 1e3,
                "c": self.c, "verify_ms": [v * 1e3 for v in self.verify_s], "verify_ratio": self.verify_ratio}


def measure_spec_costs(target: LlamaForCausalLM, draft: LlamaForCausalLM | None, use_cuda_graphs: bool,
                       cfg: StepCostConfig | None = None) -> SpecCosts:
    """c (when a draft is given) and v(K) for K = 0..k_max at batch 1."""
    cfg = cfg or StepCostConfig()
    plain_shape = (1, False)
    verify_shapes = [(k + 1, True) for k in range(cfg.k_max + 1)]
    times = step_times(target, [plain_shape, *verify_shapes], use_cuda_graphs, cfg)
    verify_s = [times[shape].median_s for shape in verify_shapes]
    draft_s = step_times(draft, [plain_shape], use_cuda_graphs, cfg)[plain_shape].median_s if draft else None
    # measured again last: the smaller median guards against a slow start (clocks, lazy init)
    again = step_times(target, [plain_shape], use_cuda_graphs, cfg)[plain_shape].median_s
    plain = min(times[plain_shape].median_s, again)
    return SpecCosts(use_cuda_graphs, plain, draft_s, None if draft_s is None else draft_s / plain,
                     verify_s, [v / plain for v in verify_s])
