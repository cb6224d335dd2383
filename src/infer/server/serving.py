"""Admission and shutdown: prepared requests in, their choices (`Jobs`) out.

`ServerState` is everything one app needs. `submit` admits at most `max_batch_size + max_queued_requests` open
choices (an `n` over that: 400; no room now: 429 with Retry-After; a dead engine or a shutdown: 503). After
`begin_shutdown` new requests get 503, and those still open at `shutdown_timeout_s` end with one.
docs/server.md, "Security and limits"."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from infer.engine.async_engine import AsyncEngine
from infer.engine.request import StepOutput
from infer.server.config import ServerConfig
from infer.server.connections import OverloadLog
from infer.server.errors import RATE_LIMIT, UNAVAILABLE, APIError, bad_request, engine_unavailable
from infer.server.grammars import GrammarService
from infer.server.jobs import Job, Jobs, shutdown_error
from infer.server.logprob_format import LogprobFormatter
from infer.server.metrics import ServerMetrics
from infer.server.prepare import Prepared, Preparer
from infer.server.responses import SpeculativeStats

RETRY_AFTER_S = 1
log = logging.getLogger("infer.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    in_flight: int = 0  # HTTP requests being handled (maintained by the ASGI middleware)
    reserved: int = 0  # choices admitted but not yet handed to the engine
    shutting_down: bool = False
    jobs: set[Job] = field(default_factory=set)  # choices admitted and not yet finished
    overload: OverloadLog = field(default_factory=OverloadLog)  # one log line per kind of overload and interval
    metrics: ServerMetrics = field(init=False)
    preparer: Preparer = field(init=False)
    grammars: GrammarService = field(init=False)
    logprob_format: LogprobFormatter = field(init=False)  # token strings and bytes, cached per id

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine, self.queue_depth, lambda: self.in_flight)
        self.preparer = Preparer(self.engine.engine, self.config)
        self.grammars = GrammarService(self.engine.engine, self.config)
        self.logprob_format = LogprobFormatter(self.engine.engine.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_seq_len(self) -> int:
        return self.engine.engine.resolved.scheduler.max_seq_len

    @property
    def open_choices(self) -> int:
        """Choices admitted and not yet finished: what the admission cap counts."""
        return len(self.jobs)

    @property
    def capacity(self) -> int | None:
        """Open choices the server holds at most (None: unlimited)."""
        limit = self.config.max_queued_requests
        return None if limit is None else self.engine.engine.resolved.scheduler.max_batch_size + limit

    @property
    def running_limit(self) -> int:
        """Choices of one request in the engine at once."""
        if self.config.max_running_choices is not None:
            return self.config.max_running_choices
        return max(1, self.engine.engine.resolved.scheduler.max_batch_size // 2)

    def queue_depth(self) -> int:
        return self.reserved + self.engine.num_queued()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")

    def check_accepting(self) -> None:
        self.check_open()
        if not self.engine.healthy:
            raise engine_unavailable(self.engine.error)

    def check_open(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down: retry against another instance or after the restart",
                           UNAVAILABLE, None, "server_shutting_down")

    def begin_shutdown(self) -> None:
        """Refuse new requests; end those still open after shutdown_timeout_s (event loop thread)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        asyncio.get_running_loop().call_later(self.config.shutdown_timeout_s, self._end_open_requests)

    def close(self) -> None:
        """Stop the preparation threads and the grammar workers (after the HTTP server stopped)."""
        self.preparer.close()
        self.grammars.close()

    def _end_open_requests(self) -> None:
        waiting = self.preparer.abandon(shutdown_error())
        if self.open_choices or waiting:
            log.warning("shutdown timeout (%.1f s): ending %d open choice(s) and %d request(s) being prepared",
                        self.config.shutdown_timeout_s, self.open_choices, waiting)
        for job in list(self.jobs):
            job.close(reason="shutdown")


async def submit(state: ServerState, prepared: Prepared, prefix: str) -> tuple[str, Jobs]:
    """Admit a prepared request after compiling its grammar (400 if it cannot be): (its id, its
    choices, the first one started)."""
    state.check_accepting()
    compiled = await state.grammars.compile(prepared.params[0].structured)
    state.check_accepting()
    n = len(prepared.params)
    capacity = state.capacity
    if capacity is not None and n > capacity:
        raise bad_request(f"n = {n} choices can never be admitted: this server holds at most {capacity} open "
                          "choices (max_batch_size + --max-queued-requests): lower n", "n", "n_too_large")
    if capacity is not None and state.open_choices + n > capacity:
        what = "request" if n == 1 else f"request's {n} choices"
        raise APIError(429, f"the server is full ({capacity} open choices) for this {what}: retry after "
                            f"{RETRY_AFTER_S} s", RATE_LIMIT, None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    base = f"{prefix}-{uuid.uuid4().hex}"
    jobs = Jobs([Job(state, base if n == 1 else f"{base}-{i}", prepared.prompt_ids, p, compiled)
                 for i, p in enumerate(prepared.params)], state.running_limit)
    state.metrics.prompt_tokens.inc(len(prepared.prompt_ids))
    try:
        await jobs.start_first()
        # a shutdown while it prefilled (later engine failures reach it as error events, 500)
        state.check_open()
    except BaseException:
        jobs.close()
        raise
    return base, jobs


def spec_stats(out: StepOutput) -> SpeculativeStats | None:
    if out.acceptance_rate is None and out.mean_accepted_length is None:
        return None
    return SpeculativeStats(acceptance_rate=out.acceptance_rate, mean_accepted_length=out.mean_accepted_length)
