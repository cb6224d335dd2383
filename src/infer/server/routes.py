"""Handlers of /v1/completions and /v1/chat/completions: validate, submit, stream or collect.

Everything that can fail before the first byte (bad parameters, unknown model, full
queue, dead engine) fails here, so a streaming request gets a real 4xx/5xx status rather
than a 200 followed by an error event.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from infer.engine.request import StepOutput
from infer.server.errors import SERVER_ERROR, APIError, engine_unavailable
from infer.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatDelta, CompletionChoice,
                                   CompletionChunk, CompletionRequest, CompletionResponse, SpeculativeStats,
                                   Usage)
from infer.server.serving import (Job, ServerState, chat_prompt_ids, check_prompt, completion_prompt_ids,
                                  sampling_params, submit)
from infer.server.streaming import Outcome, SSEResponse, collect, event_stream, usage

CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _finish_reason(out: StepOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


def _outcome_error(state: ServerState, outcome: Outcome) -> APIError:
    if not state.engine.healthy:
        return engine_unavailable(state.engine.error)
    return APIError(500, outcome.error or "generation failed", SERVER_ERROR, None, "engine_error")


async def completion(state: ServerState, body: CompletionRequest, request: Request) -> Any:
    state.check_model(body.model)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    params = sampling_params(body, max_tokens)
    ids = completion_prompt_ids(state, body)
    check_prompt(state, ids, max_tokens, "prompt")
    job = await submit(state, ids, params, "cmpl")
    created, model = int(time.time()), state.model_name
    if body.stream:
        def chunk(out: StepOutput, spec: SpeculativeStats | None) -> dict[str, Any]:
            choice = CompletionChoice(text=out.text_delta, finish_reason=_finish_reason(out))
            return CompletionChunk(id=job.request_id, created=created, model=model, choices=[choice],
                                   speculative_decoding=spec).model_dump()

        def usage_chunk(u: Usage) -> dict[str, Any]:
            return CompletionChunk(id=job.request_id, created=created, model=model, choices=[],
                                   usage=u).model_dump()

        include = body.stream_options is not None and body.stream_options.include_usage
        return SSEResponse(event_stream(job, chunk, usage_chunk if include else None), job.close)
    outcome = await collect(job, request)
    if outcome is None:
        return Response(status_code=CLIENT_CLOSED)
    if outcome.error is not None:
        raise _outcome_error(state, outcome)
    return CompletionResponse(
        id=job.request_id, created=created, model=model,
        choices=[CompletionChoice(text=outcome.text, finish_reason=outcome.finish_reason)],  # type: ignore[arg-type]
        usage=usage(job, outcome.completion_tokens), speculative_decoding=outcome.spec)


def _chat_max_tokens(state: ServerState, body: ChatCompletionRequest, prompt_len: int) -> int:
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return explicit if explicit is not None else max(1, state.max_seq_len - prompt_len)


async def chat_completion(state: ServerState, body: ChatCompletionRequest, request: Request) -> Any:
    state.check_model(body.model)
    sampling_params(body, 1)  # parameter errors first, before the chat template runs
    ids = chat_prompt_ids(state, body)
    max_tokens = _chat_max_tokens(state, body, len(ids))
    check_prompt(state, ids, max_tokens, "messages")
    job = await submit(state, ids, sampling_params(body, max_tokens), "chatcmpl")
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return _chat_stream(state, job, include)
    outcome = await collect(job, request)
    if outcome is None:
        return Response(status_code=CLIENT_CLOSED)
    if outcome.error is not None:
        raise _outcome_error(state, outcome)
    choice = ChatChoice(message=AssistantMessage(content=outcome.text),
                        finish_reason=outcome.finish_reason)  # type: ignore[arg-type]
    return ChatCompletionResponse(id=job.request_id, model=state.model_name, choices=[choice],
                                  usage=usage(job, outcome.completion_tokens), speculative_decoding=outcome.spec)


def _chat_stream(state: ServerState, job: Job, include_usage: bool) -> SSEResponse:
    created, model = int(time.time()), state.model_name

    def make(choices: list[ChatChunkChoice], **extra: Any) -> dict[str, Any]:
        return ChatCompletionChunk(id=job.request_id, created=created, model=model, choices=choices,
                                   **extra).model_dump(exclude_none=False)

    def chunk(out: StepOutput, spec: SpeculativeStats | None) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=ChatDelta(content=out.text_delta), finish_reason=_finish_reason(out))
        return make([choice], speculative_decoding=spec)

    first = make([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    usage_chunk = (lambda u: make([], usage=u)) if include_usage else None
    return SSEResponse(event_stream(job, chunk, usage_chunk, first), job.close)
