"""OpenAI response schemas (pydantic) of every endpoint, with stream chunks. Extension:
`speculative_decoding` statistics on responses and final chunks."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Per-request speculative decoding statistics (extension; null when speculation is off)."""

    acceptance_rate: float | None = Field(description="accepted / drafted tokens, mean over rounds")
    mean_accepted_length: float | None = Field(description="tokens emitted per speculation round")


FinishReasonName = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None


class _Envelope(BaseModel):
    """The fields every response and chunk has, in OpenAI's order (a subclass narrows them)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage | None = None
    speculative_decoding: SpeculativeStats | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class FunctionCallDelta(BaseModel):
    name: str | None = None  # with the call's first delta
    arguments: str  # a fragment of the arguments' JSON text


class ToolCallDelta(BaseModel):
    index: int  # among the message's calls
    id: str | None = None  # with the call's first delta
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    choices: list[ChatChunkChoice]


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    created: int
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "infer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
