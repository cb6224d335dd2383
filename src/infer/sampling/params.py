"""Sampling parameters: `SamplingParams` and `StructuredOutput`, validated on construction,
and the bounds they are checked against (also published in the server's OpenAPI schema)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

def is_strict_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r} in {stop!r}")
    return tuple(items)


def _normalise_stop_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
    for item in ids:
        if not is_strict_int(item) or item < 0:
            raise ValueError(f"stop_token_ids must contain only integers >= 0, got {item!r} in {ids!r}")
    return tuple(ids)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match (exactly one field set), validated on construction;
    compiled against the tokenizer by `infer.engine.structured`.

    json         a JSON schema (a dict, or its JSON text; kept as compact JSON text, the
                 properties in the schema's order, which the output follows)
    json_object  True: any JSON object
    regex        a regular expression the whole output matches
    choice       the output is one of these strings
    grammar      an EBNF grammar (GBNF: `root ::= ...`)
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", _json_text(self.json))
        elif self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError(f"structured json must be a JSON schema (a dict or its JSON text), got {self.json!r}")
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured json is not valid JSON: {exc}") from None
            if not isinstance(schema, Mapping):
                raise ValueError(f"structured json must be a JSON schema object, got {self.json!r}")
            object.__setattr__(self, "json", _json_text(schema))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured json_object must be True or False, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured choice must hold only non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError("a structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name))


def _json_text(schema: Mapping[str, object]) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"))  # key order kept: it orders the output's properties
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured json schema cannot be written as JSON: {exc}") from None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters (vLLM / OpenAI style), validated on construction
    (a bad value raises ValueError naming the field).

    temperature        1.0, in [0, MAX_TEMPERATURE]; 0 = greedy (argmax). `infer generate` defaults to 0.
    top_k, top_p       -1 and 1.0: off; applied after the temperature.
    repetition_penalty 1.0 = off, in [1e-3, 1e3]; > 1 discourages tokens seen in the prompt or output.
    presence_penalty, frequency_penalty
                       0.0 = off, in [-2, 2]: subtracted from the logit of every token seen
                       in the prompt or output, once / per occurrence (OpenAI).
    max_tokens         16 (OpenAI's completions default; `infer generate` uses 128).
    stop, stop_token_ids  strings (not returned) and ids that end the output.
    ignore_eos         keep going past EOS.
    seed               None: the engine's seed decides; an int: reproducible samples.
    logprobs           None; N >= 0: each token's log-probability (raw model
                       distribution, see infer.logprobs) and the N most likely tokens.
    n                  1; independent samples (sample i > 0 seeded with derive_seed(seed, i)).
    structured         None; a StructuredOutput: tokens drawn from the model's distribution
                       restricted to what the grammar allows (EOS once it is complete).
    speculation        None: the engine's policy; False: decode plainly; K >= 1: at most K
                       drafts a round (a tree cut to depth K; `Engine.add_request` refuses a K
                       above `spec_length`). The output distribution is the target's either way.
    """

    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0  # in (0, 1]
    repetition_penalty: float = 1.0  # > 0, 1 = off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0  # in [-2, 2], 0 = off (OpenAI semantics, over prompt + output)
    frequency_penalty: float = 0.0  # in [-2, 2], 0 = off
    logprobs: int | None = None  # None = off; N = the sampled token's log-probability and the N most likely
    n: int = 1  # samples (choices) of the prompt
    structured: StructuredOutput | None = None  # None = free text
    speculation: bool | int | None = None  # None = the engine's policy; False = plain; K = at most K drafts

    def __post_init__(self) -> None:
        if not is_strict_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (samples of the prompt), got {self.n!r}")
        self._check_floats()
        self._check_openai_penalties()
        if self.logprobs is not None and (not is_strict_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not is_strict_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not is_strict_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be None or a StructuredOutput, got {self.structured!r}")
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output: the output ends with EOS "
                             "once the grammar is complete")
        if self.seed is not None and (not is_strict_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(
                f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        k = self.speculation
        if k is not None and k is not False and (not is_strict_int(k) or k < 1):
            raise ValueError(f"speculation must be None (the engine's policy), False (decode plainly) or an "
                             f"integer K >= 1 (at most K drafts a round), got {k!r}")

    def _check_floats(self) -> None:
        t, p, r = self.temperature, self.top_p, self.repetition_penalty
        if not _is_number(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}")
        if not _is_number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if not _is_number(r) or not math.isfinite(r) or not MIN_PENALTY <= r <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be a number in [{MIN_PENALTY}, {MAX_PENALTY}] "
                             f"(1 = off), got {r!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "repetition_penalty", float(r))

    def _check_openai_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
            object.__setattr__(self, name, float(value))

    @property
    def penalized(self) -> bool:
        """True when a penalty reads the context (repetition, presence or frequency)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_drafts(self) -> int | None:
        """The most tokens a round may draft for this request: None (the policy decides), 0 or K."""
        return None if self.speculation is None else int(self.speculation)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_EPS would overflow float32 logits: they mean argmax."""
        return self.temperature < GREEDY_EPS


GREEDY_EPS = 1e-5  # temperature below this samples greedily (as vLLM does)
MAX_TEMPERATURE = 100.0  # beyond it sampling is uniform in all but name (OpenAI stops at 2)
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: top_k beyond the vocabulary keeps every token
MIN_PENALTY, MAX_PENALTY = 1e-3, 1e3  # beyond these a float32 logit over/underflows
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's chat limit)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # a seed's range (torch.Generator.manual_seed's)
