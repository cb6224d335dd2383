"""Delivering a Job's tokens: server-sent events in OpenAI's chunk format, or one response.

Streaming: one chunk per generated token, in order (a speculation round that accepts several
tokens yields several chunks), a final chunk with `finish_reason` (and the request's
speculative statistics), an optional usage chunk, then `data: [DONE]`. An engine failure
mid-stream becomes an `error` event followed by `[DONE]`.

Client disconnects abort the request at once in both modes: `SSEResponse` listens for
`http.disconnect` while streaming and cancels the stream (whatever ASGI spec version the
server speaks), and `collect` races the generation against the same signal.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from infer.engine.request import StepOutput
from infer.server.errors import SERVER_ERROR, error_body
from infer.server.protocol import SpeculativeStats, Usage
from infer.server.serving import Job, failure_message, spec_stats

DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops (and closes its iterator) on client disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()
            if self.on_close is not None:
                self.on_close()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Outcome:
    """What a finished non-streaming request produced."""

    text: str
    completion_tokens: int
    finish_reason: str | None
    spec: SpeculativeStats | None
    error: str | None


def usage(job: Job, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=job.prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=job.prompt_tokens + completion_tokens)


async def _gather(job: Job) -> Outcome:
    parts: list[str] = []
    tokens = 0
    async with aclosing(job.outputs()) as outputs:
        async for out in outputs:
            tokens += out.token_id is not None
            parts.append(out.text_delta)
            if out.finished:
                error = failure_message(out)
                reason = None if error else out.finish_reason.value  # type: ignore[union-attr]
                return Outcome("".join(parts), tokens, reason, spec_stats(out), error)
    return Outcome("".join(parts), tokens, None, None, "the request ended without a final event")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(job: Job, request: Request) -> Outcome | None:
    """Run the job to the end; None (and the request aborted) if the client went away first."""
    gather = asyncio.ensure_future(_gather(job))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, gather) if not gather.done() else (watch,):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if gather.cancelled():
        job.close()
        return None
    return gather.result()


ChunkFn = Callable[[StepOutput, SpeculativeStats | None], dict[str, Any]]


async def event_stream(job: Job, chunk: ChunkFn, usage_chunk: Callable[[Usage], dict[str, Any]] | None,
                       first: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """SSE lines for one job: `chunk(out, spec)` per StepOutput, then usage, then [DONE]."""
    tokens = 0
    if first is not None:
        yield sse(first)
    async with aclosing(job.outputs()) as outputs:
        async for out in outputs:
            tokens += out.token_id is not None
            error = failure_message(out) if out.finished else None
            if error is not None:
                yield sse(error_body(error, SERVER_ERROR, None, "engine_error"))
                yield DONE
                return
            yield sse(chunk(out, spec_stats(out) if out.finished else None))
    if usage_chunk is not None:
        yield sse(usage_chunk(usage(job, tokens)))
    yield DONE
