"""OpenAI request and response schemas (pydantic) for /v1/completions, /v1/chat/completions,
/v1/models and /health.

Requests are validated strictly (no "5" -> 5 coercion) with the ranges in the schema, so the
OpenAPI document FastAPI serves says exactly what the server accepts. Extensions beyond the
OpenAI API: `top_k`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` on requests, and
`speculative_decoding` (acceptance rate, mean accepted length) on responses.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

NonEmptyStr = Annotated[str, Field(min_length=1)]
T = TypeVar("T")
OnePrompt = Annotated[list[T], Field(min_length=1, max_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a final chunk with token usage before [DONE]")


class SamplingFields(_Strict):
    """Parameters shared by completions and chat completions."""

    model: str | None = Field(None, description="served model name; default: the served model")
    temperature: float | None = Field(1.0, ge=0, description="0 = greedy")
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(-1, ge=-1, description="-1 or 0 = off (extension)")
    repetition_penalty: float | None = Field(1.0, gt=0, description="1 = off (extension)")
    stop: NonEmptyStr | list[NonEmptyStr] | None = Field(None, description="stop strings (not returned)")
    stop_token_ids: list[TokenId] | None = Field(None, description="stop token ids (extension)")
    ignore_eos: bool = Field(False, description="keep generating after EOS (extension)")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only n = 1 is supported")
    presence_penalty: float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="only 0 is supported")
    user: str | None = None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 1,
         "stop": ["."], "stream": True},
    ]})

    prompt: str | list[TokenId] | OnePrompt[str] | OnePrompt[list[TokenId]] = Field(
        description="text or token ids (a list of prompts must hold exactly one)")
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = Field(False, description="echo is not supported")
    logprobs: None = Field(None, description="logprobs are not supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens")
    logprobs: Literal[False] | None = Field(None, description="logprobs are not supported")


# -- responses ------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeStats(BaseModel):
    """Per-request speculative decoding statistics (extension; null when speculation is off)."""

    acceptance_rate: float | None = Field(description="accepted / drafted tokens, mean over rounds")
    mean_accepted_length: float | None = Field(description="tokens emitted per speculation round")


FinishReasonName = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReasonName | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative_decoding: SpeculativeStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReasonName | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    speculative_decoding: SpeculativeStats | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative_decoding: SpeculativeStats | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative_decoding: SpeculativeStats | None = None


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
