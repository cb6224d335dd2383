"""Requests -> what the engine runs: prompt token ids and one SamplingParams per choice.

Everything whose cost grows with the request (tokenizing the prompt or rendering the chat
template, checking its ids, building stop strings) runs in a small thread pool, never on the
event loop: the tokenizers release the GIL while they encode, so /health and open streams
keep answering while a multi-megabyte prompt is tokenized, and the pool's size bounds how
many prompts are tokenized (and held in memory as ids) at once. Errors are `APIError` 400s
naming the parameter to fix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from infer.engine.engine import Engine
from infer.sampling import SamplingParams, derive_seed
from infer.server.config import ServerConfig
from infer.server.errors import APIError, bad_request
from infer.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from infer.tokenization import Tokenizer, TokenLimitExceeded

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
R = TypeVar("R")


@dataclass(frozen=True)
class Prepared:
    """A validated request: its prompt and one SamplingParams per choice (`n` of them)."""

    prompt_ids: list[int]
    params: list[SamplingParams]
    echo: str | None = None  # the prompt's text, for `echo`


class Preparer:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="infer-prepare")

    @property
    def max_seq_len(self) -> int:
        return self.engine.config.max_seq_len

    async def completion(self, body: CompletionRequest) -> Prepared:
        return await self._off_loop(lambda: self._completion(body))

    async def chat(self, body: ChatCompletionRequest) -> Prepared:
        return await self._off_loop(lambda: self._chat(body))

    async def _off_loop(self, fn: Callable[[], R]) -> R:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- in the pool ----------------------------------------------------------------------------
    def _completion(self, body: CompletionRequest) -> Prepared:
        _check_supported(body)
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
            try:  # a prompt over the context is refused before its whole id list is built
                ids = self._tokenizer("prompt").encode(prompt, parse_special=self.config.allow_special_tokens,
                                                       limit=self.max_seq_len)
            except TokenLimitExceeded as exc:
                raise _too_long("prompt", exc.count, self.max_seq_len) from exc
        else:
            ids = [int(t) for t in prompt]  # (integral floats are allowed)
        self._check_prompt(ids, max_tokens, "prompt")
        if body.echo and text is None and self.engine.tokenizer is not None:
            text = self.engine.tokenizer.decode(ids)
        return Prepared(ids, params, (text or "") if body.echo else None)

    def _chat(self, body: ChatCompletionRequest) -> Prepared:
        _check_supported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_parameter")
        count = (body.top_logprobs or 0) if body.logprobs else None
        self._params(body, 1, count)  # parameter errors first, before the chat template runs
        tokenizer = self._tokenizer("messages")
        messages = [{"role": m.role, "content": m.text(), "name": m.name} for m in body.messages]
        try:
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True,
                                        parse_special=self.config.allow_special_tokens)
        except ValueError as exc:
            raise bad_request(f"messages: {exc}", "messages", "invalid_messages") from exc
        for name, given in (("max_tokens", body.max_tokens), ("max_completion_tokens", body.max_completion_tokens)):
            if given is not None and len(ids) + given > self.max_seq_len:
                raise bad_request(f"messages ({len(ids)} tokens) + {name} ({given}) exceeds the context length "
                                  f"{self.max_seq_len}: lower {name} or shorten the messages", name,
                                  "context_length_exceeded")
        explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = explicit if explicit is not None else max(1, self.max_seq_len - len(ids))
        self._check_prompt(ids, max_tokens, "messages")
        return Prepared(ids, self._params(body, max_tokens, count))

    def _tokenizer(self, param: str) -> Tokenizer:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids to /v1/completions",
                              param, "no_tokenizer")
        return tokenizer

    def _check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        """400s for an empty prompt, a request beyond the context, ids outside the vocabulary
        (the length first: it bounds the id scan)."""
        if not ids:
            raise bad_request(f"{param} is empty: give at least one token", param, "empty_prompt")
        limit = self.max_seq_len
        if len(ids) >= limit:
            raise _too_long(param, len(ids), limit)
        if len(ids) + max_tokens > limit:
            raise bad_request(f"{param} ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                              f"exceeds the context length {limit}: lower max_tokens or shorten the prompt",
                              "max_tokens", "context_length_exceeded")
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param} holds token id {bad}, outside the vocabulary (0..{vocab - 1})",
                              param, "invalid_token_id")

    @staticmethod
    def _params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        return [sampling_params(req, max_tokens, logprobs, derive_seed(req.seed, i)) for i in range(req.n)]


def _too_long(param: str, count: int, limit: int) -> APIError:
    return bad_request(f"{param} has {count} tokens; this model's context length is {limit}, which leaves no "
                       "room to generate: shorten it", param, "context_length_exceeded")


def _check_supported(body: SamplingFields) -> None:
    name = body.unsupported()
    if name is not None:
        raise bad_request(f"{name} is not supported by this server: remove it from the request", name,
                          "unsupported_parameter")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
    def value(got: float | None, default: float) -> float:
        return default if got is None else got

    try:
        return SamplingParams(
            temperature=value(req.temperature, 1.0), top_p=value(req.top_p, 1.0), top_k=int(value(req.top_k, -1)),
            repetition_penalty=value(req.repetition_penalty, 1.0),
            presence_penalty=value(req.presence_penalty, 0.0), frequency_penalty=value(req.frequency_penalty, 0.0),
            max_tokens=max_tokens, stop=req.stop,
            stop_token_ids=tuple(int(t) for t in req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            seed=seed, logprobs=logprobs)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), name if name in type(req).model_fields else None, "invalid_parameter") from exc

