"""Handlers of /v1/completions and /v1/chat/completions: prepare, submit, stream or collect.

Everything that can fail before the first byte fails here, so a streaming request gets a real
4xx/5xx status rather than a 200 followed by an error event.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from starlette.requests import Request

from infer.engine.request import StepOutput
from infer.server.protocol import ChatCompletionRequest, CompletionRequest
from infer.server.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, ChatDelta, CompletionChoice, CompletionChunk,
                                    CompletionResponse, FunctionCall, FunctionCallDelta, SpeculativeStats, ToolCall,
                                    ToolCallDelta)
from infer.server.serving import ServerState, submit
from infer.server.streaming import Outcome, SSEResponse, event_stream, whole_response
from infer.server.tool_calls import CallReader, call_id


def _finish_reason(out: StepOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _tool_delta(reader: CallReader, text: str, finish: str | None) -> tuple[ChatDelta, str | None]:
    """A chunk's delta under tools, and its finish_reason ("tool_calls" for a finished call)."""
    content, calls = reader.feed(text)
    if finish is not None:
        more, last = reader.finish(complete=finish == "stop")
        content, calls = content + more, calls + last
        finish = "tool_calls" if reader.called and finish == "stop" else finish
    deltas = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                            function=FunctionCallDelta(name=c.name, arguments=c.arguments)) for c in calls]
    return ChatDelta(content=content if content or not deltas else None, tool_calls=deltas or None), finish


def _tool_message(reader: CallReader, text: str, finish: str | None) -> tuple[AssistantMessage, str | None]:
    """A whole message under tools (the reader's result over the whole text), its finish_reason."""
    reader.feed(text)
    reader.finish(complete=finish == "stop")
    if not reader.called:
        return AssistantMessage(content=reader.content or ""), finish
    calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reader.calls]
    return AssistantMessage(content=None, tool_calls=calls), "tool_calls" if finish == "stop" else finish


async def completion(state: ServerState, request: Request) -> Any:
    state.check_accepting()
    body, prepared = await state.preparer.completion(await request.body(), state.check_model)
    request_id, jobs = await submit(state, prepared, "cmpl")
    created, model = int(time.time()), state.model_name
    fmt = state.logprob_format
    echo = prepared.echo or ""
    with_top = bool(body.logprobs)
    if body.stream:
        offsets = [len(echo)] * len(jobs)

        def make(choices: list[CompletionChoice], **extra: Any) -> dict[str, Any]:
            return CompletionChunk(id=request_id, created=created, model=model, choices=choices, **extra).model_dump()

        def chunk(index: int, out: StepOutput, spec: SpeculativeStats | None) -> dict[str, Any]:
            logprobs = None
            if out.logprobs is not None:
                logprobs = fmt.completion([out.logprobs], offsets[index], with_top)
                offsets[index] += len(logprobs.tokens[0])
            choice = CompletionChoice(index=index, text=out.text_delta, logprobs=logprobs,
                                      finish_reason=_finish_reason(out))  # type: ignore[arg-type]
            return make([choice], speculative_decoding=spec)

        first = [make([CompletionChoice(index=i, text=echo, finish_reason=None) for i in range(len(jobs))])
                 ] if prepared.echo else []
        usage_chunk = (lambda u: make([], usage=u)) if _include_usage(body) else None
        return SSEResponse(event_stream(jobs, chunk, usage_chunk, first), jobs.close)

    def choice(i: int, o: Outcome) -> CompletionChoice:
        return CompletionChoice(index=i, text=echo + o.text, finish_reason=o.finish_reason,  # type: ignore[arg-type]
                                logprobs=fmt.completion(o.logprobs, len(echo), with_top)
                                if body.logprobs is not None else None)

    return await whole_response(jobs, request, partial(CompletionResponse, id=request_id, created=created,
                                                       model=model), choice)


async def chat_completion(state: ServerState, request: Request) -> Any:
    state.check_accepting()
    body, prepared = await state.preparer.chat(await request.body(), state.check_model)
    request_id, jobs = await submit(state, prepared, "chatcmpl")
    created, model = int(time.time()), state.model_name
    fmt = state.logprob_format
    plan = prepared.tools if prepared.tools is not None and prepared.tools.mode != "none" else None
    readers = [CallReader(plan.forced, plan.names, plan.parallel) for _ in jobs] if plan is not None else None
    if body.stream:
        def make(choices: list[ChatChunkChoice], **extra: Any) -> dict[str, Any]:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       **extra).model_dump(exclude_none=False)

        def chunk(index: int, out: StepOutput, spec: SpeculativeStats | None) -> dict[str, Any]:
            logprobs = fmt.chat([out.logprobs]) if out.logprobs is not None else None
            finish = _finish_reason(out)
            delta = ChatDelta(content=out.text_delta)
            if readers is not None:
                delta, finish = _tool_delta(readers[index], out.text_delta, finish)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                     finish_reason=finish)  # type: ignore[arg-type]
            return make([choice], speculative_decoding=spec)

        first = [make([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                 for i in range(len(jobs))]
        usage_chunk = (lambda u: make([], usage=u)) if _include_usage(body) else None
        return SSEResponse(event_stream(jobs, chunk, usage_chunk, first), jobs.close)

    def choice(i: int, o: Outcome) -> ChatChoice:
        message, finish = AssistantMessage(content=o.text), o.finish_reason
        if readers is not None:
            message, finish = _tool_message(readers[i], o.text, finish)
        return ChatChoice(index=i, message=message, finish_reason=finish,  # type: ignore[arg-type]
                          logprobs=fmt.chat(o.logprobs) if body.logprobs else None)

    return await whole_response(jobs, request, partial(ChatCompletionResponse, id=request_id, created=created,
                                                       model=model), choice)
