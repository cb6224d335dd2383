"""Request preparation off the event loop: parsing the body, tokenizing, checking, SamplingParams.

`Preparer` runs the CPU-bound work of a request in a thread pool (`run`), bounded by the model's context: an
oversized body is refused unparsed, a text longer than the context could spell untokenized. The result is
`Prepared`; errors are `APIError` 400s naming the parameter. docs/server.md, "Security and limits".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from infer.engine.batch_size import context_hint
from infer.engine.engine import Engine
from infer.sampling import SamplingParams, StructuredOutput, derive_seed
from infer.server.body import BodyLimits, parse_body
from infer.server.config import ServerConfig
from infer.server.errors import APIError, bad_request
from infer.server.guided import structured_output
from infer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from infer.server.tools import ToolPlan, tool_plan
from infer.tokenization import Tokenizer, TokenLimitExceeded

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
R = TypeVar("R")
B = TypeVar("B", CompletionRequest, ChatCompletionRequest)
ModelCheck = Callable[[str | None], None]  # raises the 404 for a model this server does not serve


@dataclass(frozen=True)
class Prepared:
    """A validated request: its prompt and one SamplingParams per choice (`n` of them)."""

    prompt_ids: list[int]
    params: list[SamplingParams]
    echo: str | None = None  # the prompt's text, for `echo`
    tools: ToolPlan | None = None  # chat: the request's tools and tool_choice


class Preparer:
    """Parses and prepares requests in its thread pool, within the bounds read off the model."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="infer-prepare")
        self.max_token_chars, structural = vocabulary_bounds(engine.tokenizer)
        self.limits = BodyLimits(engine.resolved.scheduler.max_seq_len, structural, self.max_token_chars)
        self._waits: set[asyncio.Future[APIError]] = set()

    @property
    def max_seq_len(self) -> int:
        return self.engine.resolved.scheduler.max_seq_len

    @property
    def raise_hint(self) -> str:
        """What lifts the context limit, for the over-length 400s (the server's flag)."""
        return f" (the server's operator can {context_hint(self.max_seq_len, self.engine.model_context)})"

    async def completion(self, raw: bytes, check_model: ModelCheck) -> tuple[CompletionRequest, Prepared]:
        """Parse and prepare a /v1/completions body (`check_model` runs on its `model` first)."""
        return await self._parse_and_prepare(CompletionRequest, raw, check_model, self._completion)

    async def chat(self, raw: bytes, check_model: ModelCheck) -> tuple[ChatCompletionRequest, Prepared]:
        """Parse and prepare a /v1/chat/completions body (`check_model` runs on its `model` first)."""
        return await self._parse_and_prepare(ChatCompletionRequest, raw, check_model, self._chat)

    async def _parse_and_prepare(self, kind: type[B], raw: bytes, check_model: ModelCheck,
                                 prepare: Callable[[B], Prepared]) -> tuple[B, Prepared]:
        def work() -> tuple[B, Prepared]:
            body = parse_body(kind, raw, self.limits)
            check_model(body.model)
            return body, prepare(body)
        return await self.run(work)

    async def run(self, fn: Callable[[], R]) -> R:
        """`fn()` in the pool; raises the error given to `abandon` if that comes first."""
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.pool, fn)
        abandoned: asyncio.Future[APIError] = loop.create_future()
        self._waits.add(abandoned)
        try:
            await asyncio.wait({work, abandoned}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waits.discard(abandoned)
        if not work.done():
            work.cancel()  # (a job still queued never runs; a running one ends, bounded)
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # its outcome is nobody's
            raise abandoned.result()
        return work.result()

    def abandon(self, error: APIError) -> int:
        """End every wait in `run` with `error` (event loop thread); returns how many."""
        waits = [w for w in self._waits if not w.done()]
        for wait in waits:
            wait.set_result(error)
        return len(waits)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- in the pool ----------------------------------------------------------------------------
    def _check_length(self, chars: int, param: str) -> None:
        """A text of more characters than the context's tokens can spell is refused untokenized."""
        most = self.max_seq_len * self.max_token_chars
        if chars > most:
            raise bad_request(f"{param} has {chars} characters, more than this model's context of {self.max_seq_len} "
                              f"tokens can hold (at most {self.max_token_chars} characters a token): shorten it"
                              + self.raise_hint,
                              param, "context_length_exceeded")

    def _completion(self, body: CompletionRequest) -> Prepared:
        _check_supported(body)
        self._check_stop_ids(body)
        if body.echo and body.logprobs is not None:
            raise bad_request("echo together with logprobs would need the prompt's log-probabilities, which this "
                              "server does not compute: drop one of them", "echo", "unsupported_parameter")
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params = self._params(body, max_tokens, body.logprobs)  # parameter errors before tokenizing
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list of exactly one prompt (the schema allows no more)
        text: str | None = None
        if isinstance(prompt, str):
            if prompt == "":
                raise bad_request("prompt is empty: give at least one character or token id", "prompt",
                                  "empty_prompt")
            text = prompt
            self._check_length(len(prompt), "prompt")
            try:  # a prompt over the context is refused before its whole id list is built
                ids = self._tokenizer("prompt").encode(prompt, parse_special=self.config.allow_special_tokens,
                                                       limit=self.max_seq_len)
            except TokenLimitExceeded as exc:
                raise _too_long("prompt", exc.count, self.max_seq_len, self.raise_hint) from exc
        else:
            ids = [int(t) for t in prompt]  # (integral floats are allowed)
        self._check_prompt(ids, max_tokens, "prompt", "max_tokens")
        if body.echo and text is None and self.engine.tokenizer is not None:
            text = self.engine.tokenizer.decode(ids)
        return Prepared(ids, params, (text or "") if body.echo else None)

    def _chat(self, body: ChatCompletionRequest) -> Prepared:
        _check_supported(body)
        self._check_stop_ids(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_parameter")
        count = (body.top_logprobs or 0) if body.logprobs else None
        plan = tool_plan(body)
        forced = plan.structured if plan is not None else None
        self._params(body, 1, count, forced)  # parameter errors first, before the chat template runs
        tokenizer = self._tokenizer("messages")
        messages = _template_messages(body)
        tools = plan.tools if plan is not None else None
        self._check_length(_chat_chars(body) + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0),
                           "messages")
        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True,
                                        parse_special=self.config.allow_special_tokens, tools=tools)
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", "messages", "invalid_messages") from exc
        for name, given in (("max_tokens", body.max_tokens), ("max_completion_tokens", body.max_completion_tokens)):
            if given is not None and len(ids) + given > self.max_seq_len:
                raise bad_request(f"messages ({len(ids)} tokens) + {name} ({given}) exceeds the context length "
                                  f"{self.max_seq_len}: lower {name} or shorten the messages{self.raise_hint}",
                                  "messages",
                                  "context_length_exceeded")
        explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = explicit if explicit is not None else max(1, self.max_seq_len - len(ids))
        self._check_prompt(ids, max_tokens, "messages", "messages")
        return Prepared(ids, self._params(body, max_tokens, count, forced), tools=plan)

    def _tokenizer(self, param: str) -> Tokenizer:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids to /v1/completions",
                              param, "no_tokenizer")
        return tokenizer

    def _check_prompt(self, ids: list[int], max_tokens: int, param: str, budget_param: str) -> None:
        """400s for an empty prompt, a request beyond the context (naming `budget_param`), ids
        outside the vocabulary."""
        if not ids:
            raise bad_request(f"{param} is empty: give at least one token", param, "empty_prompt")
        limit = self.max_seq_len
        if len(ids) >= limit:
            raise _too_long(param, len(ids), limit, self.raise_hint)
        if len(ids) + max_tokens > limit:
            raise bad_request(f"{param} ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                              f"exceeds the context length {limit}: lower max_tokens or shorten the {param}"
                              + self.raise_hint,
                              budget_param, "context_length_exceeded")
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param} holds token id {bad}, outside the vocabulary (0..{vocab - 1})",
                              param, "invalid_token_id")

    def _check_stop_ids(self, body: SamplingFields) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in body.stop_token_ids or () if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise bad_request(f"stop_token_ids holds {int(bad)}, outside the vocabulary (0..{vocab - 1}): such a "
                              "token is never generated", "stop_token_ids", "invalid_token_id")

    def _params(self, req: SamplingFields, max_tokens: int, logprobs: int | None,
                structured: StructuredOutput | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; 400 naming `speculation` for a K the engine does not draft."""
        params = [sampling_params(req, max_tokens, logprobs, derive_seed(req.seed, i), structured)
                  for i in range(req.n)]
        try:
            self.engine.check_speculation(params[0])
        except ValueError as exc:
            raise bad_request(str(exc), "speculation", "invalid_parameter") from exc
        return params


def vocabulary_bounds(tokenizer: Tokenizer | None) -> tuple[int, int]:
    """(the most characters one token spells, the most `,` `[` `{` in one token), each >= 1;
    (1, 1) without a tokenizer (prompts are token ids then)."""
    if tokenizer is None:
        return 1, 1
    chars, structural = 1, 1
    for token_id in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token_id)
        text = tokenizer.convert_ids_to_tokens(token_id) or ""
        spelled = raw if raw is not None else text.encode()
        chars = max(chars, len(spelled), len(text))
        structural = max(structural, spelled.count(b",") + spelled.count(b"[") + spelled.count(b"{"))
    return chars, structural


def _too_long(param: str, count: int, limit: int, hint: str) -> APIError:
    return bad_request(f"{param} has {count} tokens; this model's context length is {limit}, which leaves no "
                       f"room to generate: shorten it{hint}", param, "context_length_exceeded")


def _check_supported(body: SamplingFields) -> None:
    name = body.unsupported()
    if name is not None:
        raise bad_request(f"{name} is not supported by this server: remove it from the request", name,
                          "unsupported_parameter")


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (400 naming a message that cannot be)."""
    messages = []
    for i, message in enumerate(body.messages):
        try:
            messages.append(message.template_dict())
        except ValueError as exc:
            raise bad_request(f"messages[{i}].{exc}", "messages", "invalid_messages") from None
    return messages


def _chat_chars(body: ChatCompletionRequest) -> int:
    """The characters of the messages' text: content, names, tool calls."""
    return sum(len(m.text() or "") + len(m.name or "") + len(m.tool_call_id or "")
               + sum(len(c.function.name) + len(c.function.arguments) for c in m.tool_calls or ())
               for m in body.messages)


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """The SamplingParams of one choice; `structured` (a forced tool call) replaces the request's own."""
    def value(got: float | None, default: float) -> float:
        return default if got is None else got

    try:
        return SamplingParams(
            temperature=value(req.temperature, 1.0), top_p=value(req.top_p, 1.0), top_k=int(value(req.top_k, -1)),
            repetition_penalty=value(req.repetition_penalty, 1.0),
            presence_penalty=value(req.presence_penalty, 0.0), frequency_penalty=value(req.frequency_penalty, 0.0),
            max_tokens=max_tokens, stop=req.stop,
            stop_token_ids=tuple(int(t) for t in req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            seed=seed, logprobs=logprobs, structured=structured or structured_output(req),
            speculation=req.speculation)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), name if name in type(req).model_fields else None, "invalid_parameter") from exc

