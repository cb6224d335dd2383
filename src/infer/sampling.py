"""Sampling: validated per-request parameters and the pure logits -> probabilities pipeline.

The pipeline is the "standardized sampling" of Leviathan et al. 2023 (section 2.2): every
decoding rule (greedy, temperature, top-k, top-p, repetition penalty) is cast as plain
sampling from one adjusted distribution. Speculative verification (`infer.speculative.verifier`)
compares exactly these adjusted distributions for draft and target, which is what makes it
lossless for every sampling setting.

Order of transforms (per row, vectorised over the batch):
  1. penalties over that row's context token ids (prompt + generated so far): the
     repetition penalty (Hugging Face semantics: positive logits divided by the penalty,
     negative ones multiplied), then the presence and frequency penalties (OpenAI
     semantics: `logit - count * frequency_penalty - (count > 0) * presence_penalty`),
  2. temperature (greedy rows are left unscaled),
  3. top-k, then 4. top-p (tokens outside the kept set become -inf; the top token is always
     kept; tokens tied with the last kept logit are kept too, so the result does not depend
     on how a sort orders equal values).
Greedy rows (temperature 0) become one-hot at the argmax of the penalised logits.

Sampling draws one float64 uniform per row from the row's own CPU `torch.Generator` and
inverts the CDF, so a seeded request picks the same tokens on any device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer.transfer import tensor_on, to_device

# One row's context for the repetition penalty: token ids as a list or a 1-D tensor.
Context = Sequence[int] | torch.Tensor

NO_TOKEN = -1  # a sampled id standing for "this row had no valid distribution" (its request's fault)
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


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

    temperature        1.0, in [0, MAX_TEMPERATURE = 100]; 0 = greedy (argmax). `infer
                       generate` defaults to 0. (OpenAI allows 2; at 100 the distribution
                       is already nearly uniform, and a bound keeps logits / T finite.)
    top_k, top_p       -1 and 1.0: off. Applied after the temperature. top_k at most
                       MAX_TOP_K (any value above the vocabulary keeps every token).
    repetition_penalty 1.0 = off, in [1e-3, 1e3]; > 1 discourages tokens seen in the
                       prompt or output.
    presence_penalty, frequency_penalty
                       0.0 = off, in [-2, 2]: subtracted from the logit of every token
                       seen in the prompt or output, once / per occurrence (OpenAI).
    max_tokens         16 (OpenAI's completions default; `infer generate` uses 128).
    stop, stop_token_ids  strings (not returned) and ids that end the output.
    ignore_eos         keep going past EOS.
    seed               None: the engine's seed decides; an int: reproducible samples.
    logprobs           None; N >= 0: each token's log-probability (raw model
                       distribution, see infer.logprobs) and the N most likely tokens.
    n                  1; independent samples of the prompt (`LLM.generate` returns n
                       outputs per prompt; sample i > 0 is seeded with derive_seed(seed, i)).
    structured         None; a StructuredOutput: every token is drawn from the model's
                       distribution restricted to the tokens the grammar allows (the output
                       ends with EOS once the grammar is complete).
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
        if self.seed is not None and (not is_strict_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(
                f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")

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
    def greedy(self) -> bool:
        """Temperatures below GREEDY_EPS would overflow float32 logits: they mean argmax."""
        return self.temperature < GREEDY_EPS


GREEDY_EPS = 1e-5  # temperature below this samples greedily (as vLLM does)
MAX_TEMPERATURE = 100.0  # beyond it sampling is uniform in all but name (OpenAI stops at 2)
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: top_k beyond the vocabulary keeps every token
MIN_PENALTY, MAX_PENALTY = 1e-3, 1e3  # beyond these a float32 logit over/underflows
MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's chat limit)


def derive_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request asking for several (`n`): `seed` itself for
    index 0 (so n = 1 and the first of n samples agree), a splitmix64 mix of both otherwise;
    None (unseeded) stays None."""
    if seed is None or index == 0:
        return seed
    mask = 2**64 - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1  # in [0, 2**63)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded with `seed`, or from a nondeterministic source when None."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
        return gen
    if not is_strict_int(seed) or not _SEED_MIN <= seed <= _SEED_MAX:
        raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {seed!r}")
    gen.manual_seed(seed)
    return gen


def draw_uniforms(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """[len(generators), n] float64 uniforms in [0, 1) on CPU; row i comes from generators[i]."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not generators:
        return torch.empty(0, n, dtype=torch.float64)
    rows = [torch.rand(n, generator=g, dtype=torch.float64) for g in generators]  # each [n]
    return torch.stack(rows)


def round_uniforms(generators: Sequence[torch.Generator], counts: Sequence[int], width: int) -> torch.Tensor:
    """[len(generators), width + 1] float64 uniforms for a verification round: row i draws
    exactly counts[i] + 1 from generators[i], the first counts[i] to accept its drafts
    (columns 0..counts[i]-1) and the last to sample its final token (column `width`), so a
    seeded request's draws never depend on the other requests of its batch."""
    out = torch.zeros((len(generators), width + 1), dtype=torch.float64)
    for i, (g, k) in enumerate(zip(generators, counts, strict=True)):
        row = torch.rand(k + 1, generator=g, dtype=torch.float64)
        out[i, :k] = row[:k]
        out[i, width] = row[k]
    return out


def _check_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 contexts: Sequence[Context] | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"params has {len(params)} entries but logits has {logits.shape[0]} rows")
    if contexts is not None and len(contexts) != logits.shape[0]:
        raise ValueError(f"contexts has {len(contexts)} entries but logits has {logits.shape[0]} rows")


def _context_ids(ctx: Context) -> torch.Tensor:
    """One row's context as a 1-D long tensor (lists go through numpy: far faster than torch.tensor)."""
    if isinstance(ctx, torch.Tensor):
        return ctx.reshape(-1).to(torch.long)
    return torch.from_numpy(np.fromiter(ctx, dtype=np.int64, count=len(ctx)))


def _penalty_indices(params: Sequence[SamplingParams], contexts: Sequence[Context], vocab: int,
                     device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
    """(penalized rows [R], local row index [M] in 0..R-1, token ids [M]) with the ids on
    `device`, over every context token of each penalized row; None when no row has one."""
    rows, parts = [], []
    for row, (p, ctx) in enumerate(zip(params, contexts)):
        if p.penalized and len(ctx) > 0:
            rows.append(row)
            parts.append(_context_ids(ctx))
    if not rows:
        return None
    lengths = torch.tensor([t.numel() for t in parts])  # [R]
    if all(t.device.type == "cpu" for t in parts):
        ids = torch.cat(parts)  # [M] on CPU: range check without a device sync
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"contexts hold token ids outside [0, {vocab}): check the prompt token ids")
        ids = to_device(ids, device)
    else:  # ids already on a device are trusted (checking them would cost a host sync)
        ids = torch.cat([to_device(t, device) for t in parts])  # [M]
    local = to_device(torch.repeat_interleave(torch.arange(len(rows)), lengths), device)  # [M]
    return rows, local, ids


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                     contexts: Sequence[Context] | None) -> None:
    """In place on float32 logits [N, V]: each penalized row's penalties over its context ids.

    Repetition penalty: a token repeated in the context is penalised once (duplicate indices
    write equal values). Presence / frequency: by the token's count in the context.
    """
    if contexts is None:
        return
    found = _penalty_indices(params, contexts, logits.shape[1], logits.device)
    if found is None:
        return
    rows, local, ids = found  # [R], [M], [M]
    dev = logits.device
    index = tensor_on(rows, dev)  # [R] rows of `logits`
    repetition = [params[r].repetition_penalty for r in rows]
    if any(r != 1.0 for r in repetition):
        row_ids = index[local]  # [M]
        rep = tensor_on(repetition, dev, torch.float32)[local]  # [M]
        vals = logits[row_ids, ids]  # [M]
        logits[row_ids, ids] = torch.where(vals > 0, vals / rep, vals * rep)
    presence = [params[r].presence_penalty for r in rows]
    frequency = [params[r].frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        counts = torch.zeros((len(rows), logits.shape[1]), dtype=torch.float32, device=dev)  # [R, V]
        counts.index_put_((local, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        shift = (tensor_on(frequency, dev, torch.float32)[:, None] * counts
                 + tensor_on(presence, dev, torch.float32)[:, None] * (counts > 0))  # [R, V]
        logits[index] = logits[index] - shift


def _truncation_cutoff(sorted_desc: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest logit kept per row by top-k then top-p. sorted_desc [M, V] -> [M, 1]."""
    vocab = sorted_desc.shape[1]
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)  # [M]
    cutoff_k = sorted_desc.gather(1, (k - 1)[:, None])  # [M, 1]
    kept = torch.where(sorted_desc >= cutoff_k, sorted_desc, float("-inf"))  # [M, V]
    probs = torch.softmax(kept, dim=-1)  # [M, V]
    cum = torch.cumsum(probs, dim=-1)  # [M, V]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # [M, V]
    count = (mass_before < top_p[:, None]).sum(dim=1).clamp(min=1)  # [M]
    cutoff_p = kept.gather(1, (count - 1)[:, None])  # [M, 1]
    cutoff_p = torch.where(top_p[:, None] >= 1.0, float("-inf"), cutoff_p)
    return torch.maximum(cutoff_k, cutoff_p)


def _apply_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p set with -inf. scaled [N, V] float32."""
    vocab = scaled.shape[1]
    rows = [i for i, p in enumerate(params)
            if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if not rows:
        return scaled  # no sort needed
    dev = scaled.device
    idx = tensor_on(rows, dev)  # [M]
    top_k = tensor_on([params[i].top_k for i in rows], dev)  # [M]
    top_p = tensor_on([params[i].top_p for i in rows], dev, torch.float32)  # [M]
    sub = scaled[idx]  # [M, V]
    sorted_desc = torch.sort(sub, dim=-1, descending=True).values  # [M, V]
    cutoff = _truncation_cutoff(sorted_desc, top_k, top_p)  # [M, 1]
    scaled[idx] = torch.where(sub >= cutoff, sub, float("-inf"))
    return scaled


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  contexts: Sequence[Context] | None) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V] after repetition penalty, temperature, top-k, top-p.

    `contexts[i]` are the token ids row i has seen (prompt + generated), a list or a 1-D
    tensor (a tensor skips the list conversion); they only matter for the repetition penalty.
    Greedy rows get the penalty but no scaling or truncation (their argmax is what counts). The input tensor is not modified.
    """
    _check_batch(logits, params, contexts)
    out = logits.to(torch.float32, copy=True)  # [N, V]
    _apply_penalties(out, params, contexts)
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        out = out / tensor_on(temps, out.device, torch.float32)[:, None]
    return _apply_top_k_top_p(out, params)


def logits_to_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                    contexts: Sequence[Context] | None) -> torch.Tensor:
    """float32 [N, V] sampling distributions; greedy rows are one-hot at the penalised argmax."""
    adjusted = adjust_logits(logits, params, contexts)  # [N, V]
    probs = torch.softmax(adjusted, dim=-1)  # [N, V]
    greedy = [p.greedy for p in params]
    if any(greedy):
        mask = tensor_on(greedy, probs.device)[:, None]  # [N, 1]
        probs = torch.where(mask, one_hot_max(adjusted), probs)
    return probs


def greedy_tokens(scores: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, or NO_TOKEN where the row's maximum is not finite
    (NaN or infinite logits, or every token forbidden): scores [..., V] -> ids [...] long."""
    best, idx = scores.max(dim=-1)
    return torch.where(torch.isfinite(best), idx, NO_TOKEN)


def one_hot_max(scores: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] one-hot at each row's argmax; a row whose maximum is not finite is NaN
    throughout, so sampling from it gives NO_TOKEN."""
    best, idx = scores.max(dim=-1, keepdim=True)  # [N, 1]
    one_hot = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device).scatter_(1, idx, 1.0)
    return torch.where(torch.isfinite(best), one_hot, float("nan"))


def temperature_only(params: SamplingParams, vocab: int) -> bool:
    """True when the only transform is a temperature (or greedy): no top-k, top-p, penalty."""
    return not params.penalized and (params.greedy or (not 0 < params.top_k < vocab
                                                                    and params.top_p >= 1.0))


def temperature_probs(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """`logits_to_probs` for rows whose only transform is a temperature, in tensor form (no
    host-side branching, so a CUDA graph can hold it): logits [N, V], temperatures [N] float32
    (1.0 for greedy rows), greedy [N] bool -> float32 [N, V]; greedy rows one-hot at the argmax.
    Gives exactly `logits_to_probs`' values for such rows."""
    scaled = logits.to(torch.float32) / temperatures[:, None]  # [N, V]
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    return torch.where(greedy[:, None], one_hot_max(scaled), probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not be normalised), uniforms [N] -> ids [N] long.

    Picks the first index whose cumulative sum exceeds u * total, computed in float64. A pick
    that lands on a zero-probability token (rounding at the top end, or a parallel scan's
    noise) moves to the nearest positive token at or before it, so a token of probability 0
    is never returned. A row with no positive total (NaN or infinite values, or nothing
    allowed) gives NO_TOKEN: the request's fault, found when the host reads its token.
    """
    if probs.dim() != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(
            f"probs must be [N, V] and uniforms [N], got {tuple(probs.shape)} and {tuple(uniforms.shape)}")
    vocab = probs.shape[1]
    p = probs.to(torch.float64)  # [N, V]
    cdf = torch.cumsum(p, dim=-1)  # [N, V]
    u = to_device(uniforms, p.device).to(torch.float64)[:, None]  # [N, 1]
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)  # [N, 1]
    positive = p > 0  # [N, V]
    arange = torch.arange(vocab, device=p.device)[None, :]  # [1, V]
    # the last positive token at or before idx (one reduction, not a scan with indices)
    chosen = torch.where(positive & (arange <= idx), arange, -1).amax(dim=-1)  # [N]
    first_positive = positive.to(torch.int32).argmax(dim=-1)  # [N]
    total = cdf[:, -1]  # [N]
    ok = torch.isfinite(total) & (total > 0)
    return torch.where(ok, torch.where(chosen >= 0, chosen, first_positive), NO_TOKEN)


def sample_without_replacement(probs: torch.Tensor, uniforms: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W distinct draws a row, one after another, each from `probs` renormalised over the
    tokens not drawn yet: probs [M, V] >= 0, uniforms [M, W] -> (ids [M, W] long, the
    distribution each was drawn from [M, W, V] (normalised), drawn [M, W] bool). A draw
    finds no mass left when the row has fewer than W tokens of positive probability: it is
    not drawn (id 0, distribution all zero). Draw w uses uniform w (`sample_from_probs`)."""
    if probs.dim() != 2 or uniforms.dim() != 2 or uniforms.shape[0] != probs.shape[0]:
        raise ValueError(f"probs must be [M, V] and uniforms [M, W], got {tuple(probs.shape)} "
                         f"and {tuple(uniforms.shape)}")
    rest = probs.clone()  # [M, V]: the mass not drawn yet
    ids, dists, drawn = [], [], []
    for w in range(uniforms.shape[1]):
        mass = rest.sum(dim=-1, keepdim=True)  # [M, 1]
        ok = mass[:, 0] > 0  # [M]
        dist = torch.where(ok[:, None], rest / torch.where(ok[:, None], mass, 1.0), 0.0)  # [M, V]
        x = torch.where(ok, sample_from_probs(dist, uniforms[:, w]), 0)  # [M]
        rest = rest.scatter(1, x[:, None], 0.0)
        ids.append(x)
        dists.append(dist)
        drawn.append(ok)
    return torch.stack(ids, dim=1), torch.stack(dists, dim=1), torch.stack(drawn, dim=1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           contexts: Sequence[Context] | None,
           generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row: logits [N, V] -> ids [N] long (one uniform drawn per row)."""
    if len(generators) != logits.shape[0]:
        raise ValueError(f"generators has {len(generators)} entries but logits has {logits.shape[0]} rows")
    probs = logits_to_probs(logits, params, contexts)  # [N, V]
    return sample_from_probs(probs, draw_uniforms(generators, 1)[:, 0])
