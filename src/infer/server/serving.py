"""Admission, jobs and shutdown: prepared requests in, streams of StepOutputs out.

`ServerState` is everything one app needs (the AsyncEngine, its ServerConfig, the Preparer,
metrics, the open jobs). `submit` applies admission control (503 when the engine loop died
or the server is shutting down, 429 with Retry-After when the waiting queue cannot take
the request's `n` choices, each counted once) and returns one `Job` per choice. With
`n` > 1 the first choice is submitted alone and the others once it has produced its first
token: by then its prompt's KV blocks are in the prefix cache, which the others share.

Shutdown (`begin_shutdown`): new requests get 503; requests still open after
`shutdown_timeout_s` are aborted, and their clients get an error (an error event on a
stream) saying that the server shut down.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from infer.engine.async_engine import AsyncEngine
from infer.engine.request import FinishReason, StepOutput
from infer.sampling import SamplingParams
from infer.server.config import ServerConfig
from infer.server.errors import RATE_LIMIT, SERVER_ERROR, UNAVAILABLE, APIError, bad_request, engine_unavailable
from infer.server.logprob_format import LogprobFormatter
from infer.server.metrics import RequestTracker, ServerMetrics
from infer.server.prepare import Prepared, Preparer
from infer.server.responses import SpeculativeStats

RETRY_AFTER_S = 1
log = logging.getLogger("infer.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    in_flight: int = 0  # HTTP requests being handled (maintained by the ASGI middleware)
    reserved: int = 0  # choices admitted but not yet handed to the engine (n > 1)
    shutting_down: bool = False
    jobs: set[Job] = field(default_factory=set)
    metrics: ServerMetrics = field(init=False)
    preparer: Preparer = field(init=False)
    logprob_format: LogprobFormatter = field(init=False)  # token strings and bytes, cached per id

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.engine, self.queue_depth, lambda: self.in_flight)
        self.preparer = Preparer(self.engine.engine, self.config)
        self.logprob_format = LogprobFormatter(self.engine.engine.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_seq_len(self) -> int:
        return self.engine.engine.config.max_seq_len

    def queue_depth(self) -> int:
        return self.reserved + self.engine.num_queued()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")

    def check_accepting(self) -> None:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down: retry against another instance or after the restart",
                           UNAVAILABLE, None, "server_shutting_down")
        if not self.engine.healthy:
            raise engine_unavailable(self.engine.error)

    def begin_shutdown(self) -> None:
        """Refuse new requests; abort those still open after shutdown_timeout_s (event loop thread)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        asyncio.get_running_loop().call_later(self.config.shutdown_timeout_s, self._abort_open_jobs)

    def _abort_open_jobs(self) -> None:
        if self.jobs:
            log.warning("shutdown timeout (%.1f s): aborting %d open request(s)", self.config.shutdown_timeout_s,
                        len(self.jobs))
        for job in list(self.jobs):
            job.close(reason="shutdown")


@dataclass(eq=False)
class Job:
    """One choice of an admitted request: read `outputs()` to the end, or it is aborted."""

    state: ServerState
    request_id: str
    prompt_tokens: int
    stream: AsyncIterator[StepOutput]
    tracker: RequestTracker
    abort_reason: str | None = None  # "shutdown" once the server aborted it
    _peeked: list[StepOutput] = field(default_factory=list)

    async def peek(self) -> None:
        """Wait for the first output (it is kept and yielded first by `outputs`)."""
        self._peeked.append(await anext(self.stream))  # type: ignore[call-overload]

    async def outputs(self) -> AsyncIterator[StepOutput]:
        reason = "abort"
        try:
            async with aclosing(self.stream) as stream:  # type: ignore[type-var]
                for out in self._peeked:
                    reason = self._count(out, reason)
                    yield out
                if not (self._peeked and self._peeked[-1].finished):
                    async for out in stream:
                        reason = self._count(out, reason)
                        yield out
        finally:
            if reason == "abort":
                self.close()
            self.tracker.finish(reason)
            self.state.jobs.discard(self)

    def _count(self, out: StepOutput, reason: str) -> str:
        if out.token_id is not None:
            self.tracker.on_token()
        if out.finished:
            return out.finish_reason.value if out.finish_reason else "stop"
        return reason

    def close(self, reason: str = "abort") -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.tracker.done:
            if reason == "shutdown":
                self.abort_reason = reason
            self.state.engine.abort(self.request_id)
            self.tracker.finish("abort")

    def failure(self, out: StepOutput) -> APIError | None:
        """The error a final event stands for (engine failure, abort), or None for a normal finish."""
        if out.finish_reason is FinishReason.ERROR:
            log.error("request %s failed in the engine: %s", self.request_id, out.error)
            return APIError(500, "the engine failed while generating this request; the server log has the details",
                            SERVER_ERROR, None, "engine_error")
        if out.finish_reason is FinishReason.ABORT:
            if self.abort_reason == "shutdown":
                return APIError(503, "the server shut down before this request finished: retry it",
                                UNAVAILABLE, None, "server_shutdown")
            return APIError(500, "the request was aborted", SERVER_ERROR, None, "aborted")
        return None


class Jobs(list[Job]):
    """The choices of one request, in index order."""

    def close(self) -> None:
        for job in self:
            job.close()


async def _add(state: ServerState, ids: list[int], params: SamplingParams, request_id: str) -> Job:
    engine = state.engine
    try:
        stream = await engine.add_request(ids, params, request_id)
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_request") from exc
    except RuntimeError as exc:
        if not engine.healthy:
            raise engine_unavailable(engine.error) from exc
        raise
    job = Job(state, request_id, len(ids), stream, state.metrics.track(len(ids)))
    state.jobs.add(job)
    return job


async def submit(state: ServerState, prepared: Prepared, prefix: str) -> tuple[str, Jobs]:
    """Admit a prepared request: (its id, one Job per choice)."""
    state.check_accepting()
    n = len(prepared.params)
    limit = state.config.max_queued_requests
    if limit is not None and state.queue_depth() + n > limit:
        what = "request" if n == 1 else f"request's {n} choices"
        raise APIError(429, f"the waiting queue is full ({limit} requests) for this {what}: retry after "
                            f"{RETRY_AFTER_S} s", RATE_LIMIT, None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    base = f"{prefix}-{uuid.uuid4().hex}"
    ids = prepared.prompt_ids
    jobs = Jobs()
    state.reserved += n - 1
    left = n - 1  # reserved choices not yet handed to the engine
    try:
        jobs.append(await _add(state, ids, prepared.params[0], base if n == 1 else f"{base}-0"))
        if n > 1:
            await jobs[0].peek()  # its prompt is cached now: the other choices share its blocks
            state.check_accepting()  # (a shutdown or an engine failure while it prefilled)
            for i in range(1, n):
                state.reserved -= 1
                left -= 1
                jobs.append(await _add(state, ids, prepared.params[i], f"{base}-{i}"))
    except BaseException:
        jobs.close()
        raise
    finally:
        state.reserved -= left
    return base, jobs


def spec_stats(out: StepOutput) -> SpeculativeStats | None:
    if out.acceptance_rate is None and out.mean_accepted_length is None:
        return None
    return SpeculativeStats(acceptance_rate=out.acceptance_rate, mean_accepted_length=out.mean_accepted_length)
