"""RequestOutput / CompletionOutput: what `LLM.generate` returns (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
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
