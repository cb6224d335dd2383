"""Turning OpenAI requests into engine requests: prompts, sampling parameters, admission.

`ServerState` is everything one app needs (the AsyncEngine, the served model name, the
queue limit, metrics). `prepare_*` validate a request into prompt token ids and
SamplingParams, raising `APIError` 400/404 that name the offending parameter; `submit`
applies admission control (503 when the engine loop died, 429 with Retry-After when the
waiting queue is full) and returns a `Job` whose `outputs()` streams the request's
StepOutputs and aborts the request if it is not read to the end.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from infer.engine.async_engine import AsyncEngine
from infer.engine.request import FinishReason, StepOutput
from infer.sampling import SamplingParams
from infer.server.errors import RATE_LIMIT, APIError, bad_request, engine_unavailable
from infer.server.metrics import RequestTracker, ServerMetrics
from infer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, SpeculativeStats

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    max_queued_requests: int | None = None
    pending: int = 0  # add_request calls not yet acknowledged by the engine thread
    in_flight: int = 0  # HTTP requests being handled (maintained by the ASGI middleware)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None (unlimited), got {self.max_queued_requests}")
        self.metrics = ServerMetrics(self.engine, self.queue_depth, lambda: self.in_flight)

    @property
    def max_seq_len(self) -> int:
        return self.engine.engine.config.max_seq_len

    def queue_depth(self) -> int:
        return self.pending + self.engine.num_waiting()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")


# -- prompts ----------------------------------------------------------------------------------


def completion_prompt_ids(state: ServerState, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of exactly one prompt (the schema allows no more)
    if isinstance(prompt, list):
        return list(prompt)  # token ids
    if prompt == "":
        raise bad_request("prompt is empty: give at least one character or token id", "prompt", "empty_prompt")
    return _tokenizer(state, "prompt").encode(prompt)


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tokenizer = _tokenizer(state, "messages")
    messages = [{"role": m.role, "content": m.text(), "name": m.name} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise bad_request(f"messages: {exc}", "messages", "invalid_messages") from exc
    assert isinstance(text, str)
    return tokenizer.encode(text, add_special_tokens=False)


def _tokenizer(state: ServerState, param: str):  # noqa: ANN202 - Tokenizer
    tokenizer = state.engine.engine.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids to /v1/completions",
                          param, "no_tokenizer")
    return tokenizer


def check_prompt(state: ServerState, ids: list[int], max_tokens: int, param: str) -> None:
    """400s for an empty prompt, ids outside the vocabulary, or a request beyond the context."""
    if not ids:
        raise bad_request(f"{param} is empty: give at least one token", param, "empty_prompt")
    vocab = state.engine.engine.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{param} holds token id {bad}, outside the vocabulary (0..{vocab - 1})",
                          param, "invalid_token_id")
    limit = state.max_seq_len
    if len(ids) >= limit:
        raise bad_request(f"{param} has {len(ids)} tokens; this model's context length is {limit}, "
                          "which leaves no room to generate: shorten it", param, "context_length_exceeded")
    if len(ids) + max_tokens > limit:
        raise bad_request(f"{param} ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                          f"exceeds the context length {limit}: lower max_tokens or shorten the prompt",
                          "max_tokens", "context_length_exceeded")


def sampling_params(req: SamplingFields, max_tokens: int) -> SamplingParams:
    def value(name: str, default: object) -> object:
        got = getattr(req, name)
        return default if got is None else got

    try:
        return SamplingParams(
            temperature=value("temperature", 1.0), top_p=value("top_p", 1.0), top_k=value("top_k", -1),
            repetition_penalty=value("repetition_penalty", 1.0), max_tokens=max_tokens,
            stop=req.stop, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            seed=req.seed)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), name if hasattr(req, name) else None, "invalid_parameter") from exc


# -- admission and streaming ------------------------------------------------------------------


@dataclass
class Job:
    """One admitted request: read `outputs()` to the end, or the request is aborted."""

    state: ServerState
    request_id: str
    prompt_tokens: int
    stream: AsyncIterator[StepOutput]
    tracker: RequestTracker

    async def outputs(self) -> AsyncIterator[StepOutput]:
        reason = "abort"
        try:
            async with aclosing(self.stream) as stream:  # type: ignore[type-var]
                async for out in stream:
                    if out.token_id is not None:
                        self.tracker.on_token()
                    if out.finished:
                        reason = out.finish_reason.value if out.finish_reason else "stop"
                    yield out
        finally:
            if reason == "abort":
                self.close()
            self.tracker.finish(reason)

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.tracker.done:
            self.state.engine.abort(self.request_id)
            self.tracker.finish("abort")


async def submit(state: ServerState, ids: list[int], params: SamplingParams, prefix: str) -> Job:
    engine = state.engine
    if not engine.healthy:
        raise engine_unavailable(engine.error)
    limit = state.max_queued_requests
    if limit is not None and state.queue_depth() >= limit:
        raise APIError(429, f"the waiting queue is full ({limit} requests): retry after {RETRY_AFTER_S} s",
                       RATE_LIMIT, None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    state.pending += 1
    try:
        stream = await engine.add_request(ids, params, request_id)
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_request") from exc
    except RuntimeError as exc:
        if not engine.healthy:
            raise engine_unavailable(engine.error) from exc
        raise
    finally:
        state.pending -= 1
    return Job(state, request_id, len(ids), stream, state.metrics.track(len(ids)))


def spec_stats(out: StepOutput) -> SpeculativeStats | None:
    if out.acceptance_rate is None and out.mean_accepted_length is None:
        return None
    return SpeculativeStats(acceptance_rate=out.acceptance_rate, mean_accepted_length=out.mean_accepted_length)


def failure_message(out: StepOutput) -> str | None:
    """Why a final event is not a normal finish (engine error or abort), else None."""
    if out.finish_reason is FinishReason.ERROR:
        return out.error or "the engine failed while generating"
    if out.finish_reason is FinishReason.ABORT:
        return "the request was aborted"
    return None
