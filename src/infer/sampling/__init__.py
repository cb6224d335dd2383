"""Sampling: per-request parameters (`params`), their random draws (`draws`) and the pure
logits -> probabilities pipeline (`pipeline`), all importable from here."""

from __future__ import annotations

from infer.sampling.draws import derive_seed, draw_uniforms, make_generator, round_uniforms
from infer.sampling.params import (GREEDY_EPS, MAX_LOGPROBS, MAX_PENALTY, MAX_TEMPERATURE, MAX_TOP_K, MIN_PENALTY,
                                   SEED_MAX, SEED_MIN, SamplingParams, StructuredOutput, is_strict_int)
from infer.sampling.pipeline import (NO_TOKEN, Context, adjust_logits, greedy_tokens, logits_to_probs, one_hot_max,
                                     sample, sample_from_probs, sample_without_replacement, temperature_only,
                                     temperature_probs)

__all__ = ["GREEDY_EPS", "MAX_LOGPROBS", "MAX_PENALTY", "MAX_TEMPERATURE", "MAX_TOP_K", "MIN_PENALTY", "NO_TOKEN",
           "SEED_MAX", "SEED_MIN", "Context", "SamplingParams", "StructuredOutput", "adjust_logits", "derive_seed",
           "draw_uniforms", "greedy_tokens", "is_strict_int", "logits_to_probs", "make_generator", "one_hot_max",
           "round_uniforms", "sample", "sample_from_probs", "sample_without_replacement", "temperature_only",
           "temperature_probs"]
