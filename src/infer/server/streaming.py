"""Delivering a request's choices: server-sent events in OpenAI's chunk format, or one response.

`event_stream` turns a request's StepOutputs into chunks, an optional `usage` chunk, then `[DONE]` (a failure
mid-stream: an `error` event first). `SSEResponse` and `whole_response` stop on client disconnect; a whole
response's choices are serialized in a worker thread (`json_body`). docs/server.md, "Streaming".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from infer.engine.request import StepOutput
from infer.logprobs import TokenLogprobs
from infer.server.errors import APIError
from infer.server.responses import SpeculativeStats, Usage
from infer.server.jobs import Jobs
from infer.server.serving import spec_stats

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client


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
            iterator = self.body_iterator
            if isinstance(iterator, AsyncGenerator):
                await iterator.aclose()
            if self.on_close is not None:
                self.on_close()


class JSONStream(StreamingResponse):
    """An application/json response whose body arrives in parts (see `json_body`)."""

    media_type = "application/json"


async def json_body(whole: BaseModel, choices: Sequence[Callable[[], BaseModel]]) -> AsyncIterator[bytes]:
    """`whole` (its `choices` empty) as JSON, each of `choices` made and serialized in a worker thread."""
    fields = whole.model_dump(mode="json", exclude={"choices"})
    yield ("{" + "".join(f"{json.dumps(k)}:{json.dumps(v, ensure_ascii=False)}," for k, v in fields.items())
           + '"choices":[').encode()
    for i, make in enumerate(choices):
        part = await asyncio.to_thread(_dump, make)
        yield b"," + part if i else part
    yield b"]}"


def _dump(make: Callable[[], BaseModel]) -> bytes:
    return make().model_dump_json().encode()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Outcome:
    """What one finished choice produced."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    spec: SpeculativeStats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


async def _gather(jobs: Jobs) -> list[Outcome] | APIError:
    outcomes = [Outcome() for _ in jobs]
    parts: list[list[str]] = [[] for _ in jobs]
    try:
        async with aclosing(jobs.outputs()) as outputs:
            async for index, out in outputs:
                outcome = outcomes[index]
                outcome.completion_tokens += out.token_id is not None
                parts[index].append(out.text_delta)
                if out.logprobs is not None:
                    outcome.logprobs.append(out.logprobs)
                if out.finished:
                    error = jobs[index].failure(out)
                    if error is not None:
                        return error
                    outcome.finish_reason = out.finish_reason.value  # type: ignore[union-attr]
                    outcome.spec = spec_stats(out)
    except APIError as exc:  # a choice that could not start
        return exc
    for outcome, text in zip(outcomes, parts, strict=True):
        outcome.text = "".join(text)
    return outcomes


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(jobs: Jobs, request: Request) -> list[Outcome] | APIError | None:
    """Run every choice to the end: their outcomes, the error that ended one, or None (all aborted)
    if the client went away first."""
    gather = asyncio.ensure_future(_gather(jobs))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watch, gather) if not gather.done() else (watch,):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if gather.cancelled():
        for job in jobs:
            job.close()
        return None
    return gather.result()


async def whole_response(jobs: Jobs, request: Request, envelope: Callable[..., BaseModel],
                         choice: Callable[[int, Outcome], BaseModel]) -> Response:
    """`envelope(choices=[], usage, speculative_decoding)` with `choice(i, outcome)` for each
    choice `collect`ed; the error that ended one raised; CLIENT_CLOSED if the client left."""
    outcomes = await collect(jobs, request)
    if outcomes is None:
        return Response(status_code=CLIENT_CLOSED)
    if not isinstance(outcomes, list):
        raise outcomes
    whole = envelope(choices=[], usage=usage(jobs.prompt_tokens, sum(o.completion_tokens for o in outcomes)),
                     speculative_decoding=outcomes[0].spec)
    return JSONStream(json_body(whole, [partial(choice, i, o) for i, o in enumerate(outcomes)]))


ChunkFn = Callable[[int, StepOutput, SpeculativeStats | None], dict[str, Any]]


async def event_stream(jobs: Jobs, chunk: ChunkFn, usage_chunk: Callable[[Usage], dict[str, Any]] | None,
                       first: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
    """SSE lines for a request's choices: `first` chunks, `chunk(index, out, spec)` per
    StepOutput, then usage, then [DONE]."""
    tokens = 0
    for payload in first:
        yield sse(payload)
    try:
        async with aclosing(jobs.outputs()) as outputs:
            async for index, out in outputs:
                tokens += out.token_id is not None
                error = jobs[index].failure(out) if out.finished else None
                if error is not None:
                    yield sse(error.body())
                    yield DONE
                    return
                yield sse(chunk(index, out, spec_stats(out) if out.finished else None))
    except APIError as exc:  # a choice that could not start
        yield sse(exc.body())
        yield DONE
        return
    if usage_chunk is not None:
        yield sse(usage_chunk(usage(jobs.prompt_tokens, tokens)))
    yield DONE
