"""OutputProcessor: turns sampled tokens into StepOutputs and decides when a request stops;
RequestOutput / CompletionOutput: what `LLM.generate` returns (vLLM's shape).

Stop conditions, checked after each token (accepted speculative tokens one by one): EOS ids (unless ignore_eos),
stop token ids, stop strings (text cut before them; text that could still become one is held back), max_tokens,
max_seq_len."""

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
    __slots__ = ("detok", "text", "emitted", "rendered")

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok = detok
        self.text = ""  # all decoded output text
        self.emitted = 0  # characters of `text` already sent
        self.rendered = 0  # output tokens turned into StepOutputs


@dataclass(slots=True)
class _Accepted:
    """A token accepted for a request, waiting to be rendered into a StepOutput."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None
    reason: FinishReason | None  # the finish this token decided on its id (EOS, stop id, length)


class OutputProcessor:
    """Tokens become StepOutputs in two phases. `accept` records a token id and decides the
    finishes that depend on ids alone (the request is then `stop_pending`). `render`
    detokenizes in order, checks stop strings (dropping tokens after a hit) and builds the
    StepOutputs; a request is FINISHED once its last token is rendered."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len
        self._states: dict[str, _TextState] = {}
        self._accepted: list[_Accepted] = []

    def accept(self, request: Request, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record one sampled token id (and its log-probabilities, if asked for)."""
        if request.is_finished or request.stop_pending is not None:
            raise RuntimeError(f"request {request.request_id} takes no more tokens")
        params = request.sampling_params
        request.output_token_ids.append(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        reason = None
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif (len(request.output_token_ids) >= params.max_tokens
              or len(request.prompt_token_ids) + len(request.output_token_ids) >= self.max_seq_len):
            reason = FinishReason.LENGTH  # (accepted tokens only: a token in flight is not held yet)
        request.stop_pending = reason
        self._accepted.append(_Accepted(request, token_id, logprobs, reason))

    def render(self, upto: int | None = None) -> list[tuple[Request, StepOutput]]:
        """StepOutputs of the accepted tokens not rendered yet (the first `upto` of them), in
        order; none for requests finished meanwhile (aborted, or cut by a stop string)."""
        upto = len(self._accepted) if upto is None else upto
        accepted, self._accepted = self._accepted[:upto], self._accepted[upto:]
        return [(a.request, self._render(a)) for a in accepted if not a.request.is_finished]

    def num_accepted(self) -> int:
        """Accepted tokens waiting to be rendered."""
        return len(self._accepted)

    def _render(self, a: _Accepted) -> StepOutput:
        request, token_id = a.request, a.token_id
        params = request.sampling_params
        state = self._state(request)
        state.rendered += 1
        state.text += state.detok.push(token_id) if state.detok is not None else ""
        reason, cut = a.reason, None
        if params.stop and (hit := _find_stop(state.text, params.stop, state.emitted)) is not None:
            reason, cut = FinishReason.STOP, hit
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
            out.logprobs = a.logprobs
            return out
        return StepOutput(request.request_id, token_id, delta, logprobs=a.logprobs)

    def finish_without_token(self, request: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
        """Final event for an aborted or failed request."""
        return self._finish(request, reason, None, "", error)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _finish(self, request: Request, reason: FinishReason, token_id: int | None, delta: str,
                error: str | None = None) -> StepOutput:
        """The request ends here: tokens accepted after its last rendered one are dropped."""
        state = self._states.pop(request.request_id, None)
        rendered = state.rendered if state is not None else 0
        del request.output_token_ids[rendered:]
        del request.output_logprobs[rendered:]
        request.state = RequestState.FINISHED
        request.stop_pending = None
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        return StepOutput(request.request_id, token_id, delta, finished=True, finish_reason=reason,
                          acceptance_rate=request.mean_acceptance_rate(),
                          mean_accepted_length=request.mean_accepted_length(), error=error)

    def _state(self, request: Request) -> _TextState:
        state = self._states.get(request.request_id)
        if state is None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids) if self.tokenizer else None
            state = _TextState(detok)
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


class StepRender:
    """The outputs of one engine step: the tokens accepted before it (`backlog`, rendered once
    the step's GPU work is queued), then those it accepted itself (`finish`)."""

    def __init__(self, output: OutputProcessor) -> None:
        self.output = output
        self.pending = output.num_accepted()  # the backlog, not rendered yet
        self.outputs: list[tuple[Request, StepOutput]] = []

    def backlog(self) -> None:
        """Render the backlog (a no-op after the first call)."""
        pending, self.pending = self.pending, 0
        if pending:
            self.outputs += self.output.render(upto=pending)

    def finish(self, render_new: bool) -> list[tuple[Request, StepOutput]]:
        """The step's outputs: the backlog, and (render_new) everything accepted since."""
        self.backlog()
        if render_new:
            self.outputs += self.output.render()
        return self.outputs
