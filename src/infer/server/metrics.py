"""Prometheus metrics of one server app, in its own CollectorRegistry (no global state).

`ServerMetrics` holds what the server pushes as requests run (requests by endpoint and status,
finish reasons, latencies, token counts); `EngineCollector` reads the engine's state, the
speculation counters of `SpecStats` and the batch gate's state at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infer.speculative.metrics import SpecStats
from infer.speculative.policy import RoundClock

if TYPE_CHECKING:
    from infer.engine.async_engine import AsyncEngine
    from infer.cache.protocol import CachePoolProtocol
    from infer.engine.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def kv_cache_usage(engine: Engine) -> float:
    """Fraction of KV cache memory in use, of the fullest pool (paged: blocks neither free nor
    evictable; contiguous: slots taken)."""
    usages = [_pool_usage(pool, engine) for pool in engine.kv.pools()]
    return max(usages) if usages else 0.0


def _pool_usage(pool: CachePoolProtocol, engine: Engine) -> float:
    total, free = pool.total_token_capacity(), pool.free_token_capacity()
    if total and free is not None:
        return max(0.0, min(1.0, 1.0 - free / total))
    return len(engine.scheduler.running) / engine.resolved.scheduler.max_batch_size


class EngineCollector(Collector):
    """Gauges and speculation counters read from the engine when /metrics is scraped."""

    def __init__(self, engine: AsyncEngine, queue_depth: Callable[[], int],
                 in_flight: Callable[[], int]) -> None:
        self.engine = engine
        self.queue_depth = queue_depth
        self.in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        yield _gauge("infer_num_requests_running", "requests holding a KV cache slot",
                     self.engine.num_running())
        yield _gauge("infer_num_requests_waiting", "requests queued for admission (incl. being added)",
                     self.queue_depth())
        yield _gauge("infer_http_requests_in_flight", "HTTP requests being handled", self.in_flight())
        yield _gauge("infer_kv_cache_usage_ratio", "fraction of KV cache memory in use",
                     kv_cache_usage(self.engine.engine))
        yield _gauge("infer_engine_healthy", "1 while the engine loop runs", int(self.engine.healthy))
        yield from spec_metrics(self.engine.engine.runner.stats)
        speculation = self.engine.engine.runner.speculation
        if speculation is not None and speculation.clock is not None and speculation.clock.gate:
            yield from gate_metrics(speculation.clock)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def spec_metrics(stats: SpecStats | None) -> Iterator[Metric]:
    """Speculation counters (zero when speculation is off), and the shared-vocabulary gauge if any."""
    stats = stats if stats is not None else SpecStats()
    for name, doc in (("drafts", "speculation rounds that drafted at least one token"),
                      ("draft_tokens", "tokens proposed by the drafter"),
                      ("accepted_tokens", "drafted tokens accepted by the target"),
                      ("emitted_tokens", "tokens produced by speculation rounds (accepted + bonus)")):
        yield CounterMetricFamily(f"infer_spec_decode_{name}", doc, value=getattr(stats, name))
    for name, doc, label, counts in (
            ("accepted_per_position", "rounds whose i-th drafted token (a tree: at depth i + 1) was accepted",
             "position", stats.accepted_per_position),
            ("drafted_per_position", "rounds that drafted an i-th token (a tree: a node at depth i + 1)",
             "position", stats.drafted_per_position),
            ("accepted_length", "drafting rounds by accepted length (a tree: the accepted path's)",
             "length", stats.accepted_lengths)):
        family = CounterMetricFamily(f"infer_spec_decode_{name}", doc, labels=[label])
        for i, count in enumerate(list(counts)):
            family.add_metric([str(i)], count)
        yield family
    if stats.shared_vocabulary is not None:
        yield _gauge("infer_spec_shared_vocabulary", "a draft with another tokenizer: the share of the smaller "
                     "vocabulary both vocabularies hold", stats.shared_vocabulary)


def gate_metrics(clock: RoundClock) -> Iterator[Metric]:
    """The batch gate's view per batch-size bucket it has measured (`RoundClock.gate_state`)."""
    speedup = GaugeMetricFamily("infer_spec_batch_speedup", "speculation rounds' tokens a second over plain "
                                "steps', as the batch gate measured them, by batch-size bucket", labels=["batch"])
    on = GaugeMetricFamily("infer_spec_batch_on", "1 where the batch gate lets rounds run, 0 where steps go "
                           "plain (probed now and then), by batch-size bucket", labels=["batch"])
    for batch, (ratio, running) in clock.gate_state().items():
        speedup.add_metric([str(batch)], ratio)
        on.add_metric([str(batch)], int(running))
    yield speedup
    yield on


class RequestTracker:
    """Times one request's tokens (TTFT, inter-token latency, end to end) into the histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.tokens = 0
        self.done = False

    def on_token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += 1
        self.metrics.generation_tokens.inc()

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.finished.labels(reason=reason).inc()
        self.metrics.e2e.observe(time.perf_counter() - self.start)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, queue_depth: Callable[[], int],
                 in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("infer_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=reg)
        self.finished = Counter("infer_request_finish", "generation requests by finish reason "
                                "(stop, length, abort, error)", ["reason"], registry=reg)
        self.ttft = Histogram("infer_time_to_first_token_seconds", "time from request to first token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("infer_inter_token_latency_seconds", "time between consecutive tokens "
                             "of a request (tokens of one speculation round arrive together)",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("infer_e2e_request_latency_seconds", "time from request to last token",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("infer_prompt_tokens", "prompt tokens of accepted requests (once per "
                                     "request, whatever its n)",
                                     registry=reg)
        self.generation_tokens = Counter("infer_generation_tokens", "tokens generated", registry=reg)
        reg.register(EngineCollector(engine, queue_depth, in_flight))

    def track(self) -> RequestTracker:
        """A tracker for one choice (the prompt's tokens are counted once per request: `prompt_tokens`)."""
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)
