"""Request and StepOutput: one generation job and one token event of it.

A request receives one StepOutput per generated token, in order; with speculative decoding
one engine step may give it several.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from infer.logprobs import TokenLogprobs
from infer.sampling import SamplingParams, make_generator
from infer.speculative.grammar_mask import GrammarState


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV memory
    RUNNING = "running"  # holds a slot; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or max_seq_len
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed while serving it


@dataclass(slots=True)
class StepOutput:
    """One generated token (or the final event) for one request."""

    request_id: str
    token_id: int | None  # None only for a final event that carries no token (abort, error)
    text_delta: str  # new detokenized text (may be "" while a UTF-8 character is incomplete)
    finished: bool = False
    finish_reason: FinishReason | None = None
    acceptance_rate: float | None = None  # mean speculative acceptance, on the final event only
    mean_accepted_length: float | None = None  # mean tokens per speculation round, final event only
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # the token's log-probabilities, when its request asks for them


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # per output token, when asked for
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    slot: int | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (prefill progress)
    # tokens sampled by a step in flight whose ids the host does not have yet (overlapped scheduling)
    pending_tokens: int = 0
    # a finish decided on a token id before it is rendered: the request is scheduled no more
    stop_pending: FinishReason | None = None
    generator: torch.Generator = field(init=False)
    grammar: GrammarState | None = None
    # a fault of this request's own work: the engine fails it once the step is done
    fault: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    speculation_acceptance_rates: list[float] = field(default_factory=list)
    spec_rounds: int = 0
    spec_tokens_emitted: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        self.generator = make_generator(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token's id (not one still in flight: see `pending_tokens`)."""
        if self.pending_tokens:
            raise RuntimeError(f"request {self.request_id}'s newest token is still on the device")
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, lo: int, hi: int | None = None) -> list[int]:
        """all_token_ids[lo:hi] without concatenating the whole history (hot paths)."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        hi = p + len(output) if hi is None else hi
        if lo >= p:
            return output[lo - p:hi - p]
        if hi <= p:
            return prompt[lo:hi]
        return prompt[lo:] + output[:hi - p]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those in flight included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def tokens_left(self) -> int:
        """Output tokens the request may still emit under its max_tokens."""
        return self.sampling_params.max_tokens - len(self.output_token_ids) - self.pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def prefill_target(self) -> int:
        """Tokens to cache before decoding: all of them except the newest sampled token."""
        return self.num_tokens - (1 if self.output_token_ids or self.pending_tokens else 0)

    def can_decode(self, max_seq_len: int) -> bool:
        """Whether a decode step may still produce a token for it."""
        return (not self.is_finished and self.stop_pending is None and self.tokens_left > 0
                and self.num_tokens < max_seq_len)

    @property
    def in_prefill(self) -> bool:
        """True until every token except the last sampled one has its KV in the cache."""
        return self.num_computed_tokens < self.prefill_target

    def mean_acceptance_rate(self) -> float | None:
        rates = self.speculation_acceptance_rates
        return sum(rates) / len(rates) if rates else None

    def mean_accepted_length(self) -> float | None:
        return self.spec_tokens_emitted / self.spec_rounds if self.spec_rounds else None
