"""Start-up timing of an engine: loading the weights, allocating the KV cache and the warm-up
(CUDA graph capture, kernel compilation), logged at INFO once the engine is ready.

`TimedExecutor` wraps the runner's executor, timing its pools and keeping its forward
functions so their CUDA graphs and capture time can be summed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.capture import capture_sizes
from infer.engine.executor.factory import Executor
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.engine.parts import CacheConfig, ResolvedConfig
from infer.models.llama import LlamaForCausalLM
from infer.speculative.vocab_map import VocabMap


@dataclass
class StartupTimes:
    """Seconds of each start-up phase, and what the KV pools and CUDA graphs amount to."""

    phases: dict[str, float] = field(default_factory=dict)  # "load", "runner" (pools and warm-up included)
    kv_s: float = 0.0  # pools allocated
    kv_bytes: int = 0
    kv_tokens: list[int] = field(default_factory=list)  # each pool's capacity
    forwards: list[ForwardFn] = field(default_factory=list)  # every forward function the runner made

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def num_graphs(self) -> int:
        """CUDA graphs the engine's forward functions hold now (draft rounds and trees included)."""
        return sum(int(getattr(forward, "num_graphs", 0)) for forward in self.forwards)

    def capture_s(self) -> float:
        """Seconds those graphs took to capture."""
        return sum(float(getattr(forward, "capture_s", 0.0)) for forward in self.forwards)

    def summary(self, config: ResolvedConfig, vocab_map: VocabMap | None = None) -> str:
        """One line: the total, then each phase; with `vocab_map`, what the draft shares with the target."""
        load, runner = self.phases.get("load", 0.0), self.phases.get("runner", 0.0)
        capture = self.capture_s()
        warm = max(0.0, runner - self.kv_s - capture)
        graphs = (f"{self.num_graphs()} CUDA graphs captured in {capture:.1f} s (batch sizes "
                  f"{capture_sizes(config.scheduler.max_batch_size)})" if config.execution.use_cuda_graphs else
                  "no CUDA graphs (eager)")
        tokens = min(self.kv_tokens) if self.kv_tokens else 0
        return (f"engine ready in {load + runner:.1f} s: weights loaded in {load:.1f} s; KV cache of {tokens:,} "
                f"tokens ({self.kv_bytes / 2**30:.2f} GiB) allocated in {self.kv_s:.2f} s; {graphs}; the rest of "
                f"the warm-up (kernel compilation first) {warm:.1f} s; max_seq_len {config.scheduler.max_seq_len}, "
                f"max_batch_size {config.scheduler.max_batch_size}"
                + ("" if vocab_map is None else f"; the draft drafts over {vocab_map.describe()}"))


class TimedExecutor:
    """An executor whose pools and forward functions are timed into `times`."""

    def __init__(self, executor: Executor, times: StartupTimes) -> None:
        self.executor, self.times = executor, times

    def make_pool(self, model: LlamaForCausalLM, cache: CacheConfig, *, prefix_caching: bool) -> CachePoolProtocol:
        start = time.perf_counter()
        pool = self.executor.make_pool(model, cache, prefix_caching=prefix_caching)
        self.times.kv_s += time.perf_counter() - start
        caches = [getattr(pool, name, None) for name in ("k_cache", "v_cache")]
        self.times.kv_bytes += sum(c.numel() * c.element_size() for c in caches if c is not None)
        self.times.kv_tokens.append(pool.total_token_capacity() or pool.max_batch_size * pool.max_seq_len)
        return pool

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        forward = self.executor.make_forward(model, pool, spec)
        self.times.forwards.append(forward)
        return forward
