"""What the serving benchmark sends, and when: a seeded ShareGPT-like length mix (log-normal
prompt and output lengths) of prompts of random ids, and Poisson arrival times. The
figures behind the mix: docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

TOKEN_RANGE = (100, 8000)  # [low, high) of the prompt token ids


@dataclass(frozen=True)
class LengthMix:
    """Log-normal prompt and output lengths (tokens), clipped to [min_len, max_prompt] and
    [min_len, max_total - prompt]."""

    prompt_median: float = 100.0
    prompt_sigma: float = 1.0
    output_median: float = 250.0
    output_sigma: float = 0.8
    min_len: int = 4
    max_prompt: int = 1024
    max_total: int = 2048

    def __post_init__(self) -> None:
        if min(self.prompt_median, self.output_median) <= 0 or min(self.prompt_sigma, self.output_sigma) < 0:
            raise ValueError("length medians must be > 0 and sigmas >= 0")
        if not 1 <= self.min_len <= self.max_prompt or self.max_prompt + self.min_len > self.max_total:
            raise ValueError(f"need 1 <= min_len ({self.min_len}) <= max_prompt ({self.max_prompt}) and "
                             f"max_prompt + min_len <= max_total ({self.max_total})")

    def within(self, context_len: int | None) -> LengthMix:
        """The mix clipped to a server's context (its max_model_len): prompt + output fit."""
        if context_len is None or context_len >= self.max_total:
            return self
        if context_len < 2 * self.min_len:
            raise ValueError(f"the server's context ({context_len} tokens) is shorter than the shortest "
                             f"request ({2 * self.min_len} tokens)")
        return LengthMix(self.prompt_median, self.prompt_sigma, self.output_median, self.output_sigma,
                         self.min_len, min(self.max_prompt, context_len // 2), context_len)


SHAREGPT_LIKE = LengthMix()


@dataclass(frozen=True)
class ServeRequest:
    index: int
    prompt_ids: tuple[int, ...]
    output_len: int  # max_tokens, generated in full (ignore_eos)


def draw_requests(mix: LengthMix, n: int, seed: int, output_len: int | None = None) -> list[ServeRequest]:
    """n requests of the mix, the same for the same (mix, n, seed); `output_len` fixes every
    output's length instead (clipped to the context)."""
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = _clip(rng.lognormvariate(math.log(mix.prompt_median), mix.prompt_sigma), mix.min_len, mix.max_prompt)
        drawn = rng.lognormvariate(math.log(mix.output_median), mix.output_sigma)
        output = _clip(drawn if output_len is None else output_len, mix.min_len, mix.max_total - prompt)
        ids = tuple(rng.randrange(*TOKEN_RANGE) for _ in range(prompt))
        out.append(ServeRequest(i, ids, output))
    return out


def poisson_schedule(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of n requests arriving as a Poisson process of
    `rate` per second (gaps exponential with mean 1/rate); all zero for rate inf."""
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def _clip(value: float, low: int, high: int) -> int:
    return max(low, min(high, round(value)))
