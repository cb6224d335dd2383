"""The choices of one admitted request: `Job` (one choice) and `Jobs` (all of them).

A Job is created on admission and handed to the engine when it starts. With `n` > 1,
`Jobs.start_first` waits for choice 0's first token (its prompt is then in the prefix cache the
others share); `Jobs.outputs` starts the rest, at most `running_limit` in the engine at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from infer.engine.async_engine import AsyncEngine
from infer.engine.request import FinishReason, StepOutput
from infer.sampling import SamplingParams
from infer.server.errors import SERVER_ERROR, UNAVAILABLE, APIError, bad_request, engine_unavailable
from infer.server.metrics import RequestTracker, ServerMetrics

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger("infer.server")


class JobHost(Protocol):
    engine: AsyncEngine
    metrics: ServerMetrics
    reserved: int  # choices admitted but not yet handed to the engine
    jobs: set[Job]  # choices admitted and not yet finished


def shutdown_error() -> APIError:
    return APIError(503, "the server shut down before this request finished: retry it", UNAVAILABLE, None,
                    "server_shutdown")


@dataclass(eq=False)
class Job:
    """One choice: `start()` hands it to the engine; read `outputs()` to the end, or it is aborted."""

    host: JobHost
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    compiled: CompiledGrammar | None = None  # params.structured's grammar (server.grammars)
    stream: AsyncIterator[StepOutput] | None = None
    tracker: RequestTracker | None = None
    abort_reason: str | None = None  # "shutdown" once the server aborted it
    started: bool = False  # handed (or being handed) to the engine
    closed: bool = False  # aborted (or never to be started)
    released: bool = False  # its admission counted down
    _peeked: list[StepOutput] = field(default_factory=list)

    def __post_init__(self) -> None:  # admitted: counted until it finishes or is dropped
        self.host.jobs.add(self)
        self.host.reserved += 1

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def start(self) -> None:
        """Hand the choice to the engine (400 for input the engine refuses, 503 when it stopped)."""
        if self.closed:
            raise shutdown_error() if self.abort_reason == "shutdown" else APIError(
                500, "the request was aborted", SERVER_ERROR, None, "aborted")
        host, engine = self.host, self.host.engine
        host.reserved -= 1
        self.started = True
        try:
            self.stream = await engine.add_request(self.prompt_ids, self.params, self.request_id, self.compiled)
        except ValueError as exc:
            self._release()
            raise bad_request(str(exc), None, "invalid_request") from exc
        except RuntimeError as exc:
            self._release()
            if not engine.healthy:
                raise engine_unavailable(engine.error) from exc
            raise
        except BaseException:  # cancelled: the engine aborts what it was adding (AsyncEngine.add_request)
            self.closed = True
            self._release()
            raise
        self.tracker = host.metrics.track()

    async def peek(self) -> None:
        """Wait for the first output (it is kept and yielded first by `outputs`)."""
        assert self.stream is not None
        self._peeked.append(await anext(self.stream))  # type: ignore[call-overload]

    async def outputs(self) -> AsyncIterator[StepOutput]:
        assert self.stream is not None and self.tracker is not None
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
            self._release()

    def _count(self, out: StepOutput, reason: str) -> str:
        if out.token_id is not None:
            self.tracker.on_token()  # type: ignore[union-attr]
        if out.finished:
            return out.finish_reason.value if out.finish_reason else "stop"
        return reason

    def close(self, reason: str = "abort") -> None:
        """Abort the choice unless it already finished (idempotent); its admission is released at once."""
        if self.closed or self.released:
            return
        self.closed = True
        if reason == "shutdown":
            self.abort_reason = reason
        if not self.started:
            self.host.reserved -= 1
        else:  # (also while being added: the engine applies the abort after the add)
            self.host.engine.abort(self.request_id)
            if self.tracker is not None:
                self.tracker.finish("abort")
        self._release()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.host.jobs.discard(self)

    def failure(self, out: StepOutput) -> APIError | None:
        """The error a final event stands for (engine failure, abort), or None for a normal finish."""
        if out.finish_reason is FinishReason.ERROR:
            log.error("request %s failed in the engine: %s", self.request_id, out.error)
            if out.error is not None and out.error.startswith(f"request {self.request_id} failed"):
                # a fault of this request's own: the engine went on, the message says what broke
                return APIError(500, out.error, SERVER_ERROR, None, "request_failed")
            return APIError(500, "the engine failed while generating this request; the server log has the details",
                            SERVER_ERROR, None, "engine_error")
        if out.finish_reason is FinishReason.ABORT:
            if self.abort_reason == "shutdown":
                return shutdown_error()
            return APIError(500, "the request was aborted", SERVER_ERROR, None, "aborted")
        return None


class Jobs(list[Job]):
    """The choices of one request, in index order; at most `running_limit` in the engine at once."""

    def __init__(self, jobs: Sequence[Job], running_limit: int) -> None:
        super().__init__(jobs)
        self.running_limit = running_limit

    @property
    def prompt_tokens(self) -> int:
        return self[0].prompt_tokens

    async def start_first(self) -> None:
        """Start choice 0; with more choices, wait for its first token (its prompt is cached then)."""
        await self[0].start()
        if len(self) > 1:
            await self[0].peek()

    def close(self) -> None:
        for job in self:
            job.close()

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, output) of every choice, in arrival order; closing it aborts them all.
        A choice that cannot start raises its APIError here."""
        if len(self) == 1:
            async with aclosing(self[0].outputs()) as outputs:
                async for out in outputs:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, StepOutput | APIError | None]] = asyncio.Queue()
        slots = asyncio.Semaphore(self.running_limit)

        async def pump(index: int, job: Job) -> None:
            try:
                async with slots:  # (FIFO: choices start in index order)
                    if job.stream is None:
                        await job.start()
                    async with aclosing(job.outputs()) as outputs:
                        async for out in outputs:
                            queue.put_nowait((index, out))
            except APIError as exc:
                queue.put_nowait((index, exc))
            except Exception:  # noqa: BLE001 - reported to the client, logged here
                log.exception("choice %d of request %s failed", index, job.request_id)
                queue.put_nowait((index, APIError(500, "internal server error: the server log has the details",
                                                  SERVER_ERROR, None, "internal_error")))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(self)]
        try:
            left = len(self)
            while left:
                index, out = await queue.get()
                if out is None:
                    left -= 1
                elif isinstance(out, APIError):
                    raise out
                else:
                    yield index, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.close()
