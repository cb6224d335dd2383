"""OutputProcessor: turns sampled tokens into StepOutputs and decides when a request stops;
RequestOutput / CompletionOutput: what `LLM.generate` returns (vLLM's shape).

Stop conditions, in the order checked after each appended token: EOS ids (unless
ignore_eos), stop token ids, stop strings (the text is cut before the stop string and
nothing after it is ever emitted: text that could still become a stop string is held back
until it cannot), max_tokens, max_seq_len. Speculative runners append accepted tokens one
by one through the same path, so a stop inside an accepted run ends the output there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from infer.engine.request import FinishReason, Request, RequestState, StepOutput
from infer.logprobs import TokenLogprobs
from infer.tokenization import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # per token, when SamplingParams.logprobs asked for them
    acceptance_rate: float | None = None  # speculative decoding: mean accepted fraction per round
    mean_accepted_length: float | None = None  # speculative decoding: tokens per round


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. time_to_first_token_s, decode_tokens_per_s


class _TextState:
    __slots__ = ("detok", "text", "emitted")

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.text = ""  # all decoded output text
        self.emitted = 0  # characters of `text` already sent


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self._states: dict[str, _TextState] = {}

    def append(self, request: Request, token_id: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """Record one sampled token (and its log-probabilities, if asked for) for `request`
        and return its StepOutput."""
        if request.is_finished:
            raise RuntimeError(f"request {request.request_id} already finished")
        params = request.sampling_params
        request.output_token_ids.append(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        state = self._state(request)
        state.text += state.detok.push(token_id) if state.detok is not None else ""
        reason: FinishReason | None = None
        cut: int | None = None
        if token_id in self.eos_token_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        elif token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif params.stop and (cut := _find_stop(state.text, params.stop, state.emitted)) is not None:
            reason = FinishReason.STOP
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_seq_len:
            reason = FinishReason.LENGTH
        if reason is None:
            end = len(state.text) - _held_back(state.text, params.stop, state.emitted)
        else:
            if state.detok is not None and cut is None:
                state.text += state.detok.flush()
            end = cut if cut is not None else len(state.text)
            state.text = state.text[:end]
        delta = state.text[state.emitted:end]
        state.emitted = end
        request.output_text = state.text[:end] if reason else state.text[:state.emitted]
        if reason is not None:
            out = self._finish(request, reason, token_id, delta)
            out.logprobs = logprobs
            return out
        return StepOutput(request.request_id, token_id, delta, logprobs=logprobs)

    def finish_without_token(self, request: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
        """Final event for an aborted or failed request."""
        return self._finish(request, reason, None, "", error)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _finish(self, request: Request, reason: FinishReason, token_id: int | None, delta: str,
                error: str | None = None) -> StepOutput:
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self._states.pop(request.request_id, None)
        return StepOutput(request.request_id, token_id, delta, finished=True, finish_reason=reason,
                          acceptance_rate=request.mean_acceptance_rate(),
                          mean_accepted_length=request.mean_accepted_length(), error=error)

    def _state(self, request: Request) -> _TextState:
        state = self._states.get(request.request_id)
        if state is None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids) if self.tokenizer else None
            state = _TextState(detok)  # type: ignore[arg-type]
            self._states[request.request_id] = state
        return state


def _find_stop(text: str, stops: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts, searching only text not yet emitted."""
    longest = max(len(s) for s in stops)
    start = max(0, emitted - longest + 1)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


def _held_back(text: str, stops: tuple[str, ...], emitted: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text) - emitted), best, -1):
            if stop.startswith(text[len(text) - n:]):
                best = n
                break
    return best
