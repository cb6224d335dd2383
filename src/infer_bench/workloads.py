"""Benchmark workloads as named, validated configurations, and the prompts they produce.

W1 (one request), W2 (32 concurrent ones), W2-prefix (W2 with a shared prefix), W5 (a code
edit: a file then its first lines again) and agent (tool-calling requests, bench/agent.py);
every request sets `ignore_eos`. Prompts are seeded random ids for a model without a
tokenizer (W5's structure kept), else code from the demo corpus's validation files.
docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from infer_bench.agent import agent_prompts
from infer.corpus import split_corpus, stdlib_root
from infer.sampling import SamplingParams, StructuredOutput

KINDS = ("text", "code_edit", "agent")
JSON_RECORDS = StructuredOutput(json={
    "type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "line": {"type": "integer", "minimum": 0, "maximum": 9999}},
        "required": ["name", "line"], "additionalProperties": False}})


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Workload:
    """A named workload. `prompt_len` counts the tokens after the shared prefix; for
    "code_edit" it is the whole prompt budget (file body + repeated head)."""

    name: str
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range, drawn per request from the seed
    output_len: tuple[int, int]  # inclusive range of max_tokens (ignore_eos: exact)
    shared_prefix_len: int = 0
    kind: str = "text"  # "text" | "code_edit" | "agent"
    edit_head_tokens: int = 32  # code_edit: at least this many tokens of the file's start repeated
    temperature: float = 0.0
    seed: int = 0
    description: str = ""
    structured: StructuredOutput | None = None  # every request's structured output (None: free text)
    concurrency: int | None = None  # requests decoded at once (the engine's batch; None: all of them)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("workload name must be a non-empty string")
        if self.num_requests < 1:
            raise ValueError(f"workload {self.name}: num_requests must be >= 1, got {self.num_requests}")
        for field_name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, field_name)
            if not 1 <= lo <= hi:
                raise ValueError(f"workload {self.name}: {field_name} must be a range 1 <= lo <= hi, "
                                 f"got ({lo}, {hi})")
        if self.shared_prefix_len < 0:
            raise ValueError(f"workload {self.name}: shared_prefix_len must be >= 0")
        if self.kind not in KINDS:
            raise ValueError(f"workload {self.name}: kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.temperature < 0:
            raise ValueError(f"workload {self.name}: temperature must be >= 0, got {self.temperature}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"workload {self.name}: concurrency must be >= 1 or None, got {self.concurrency}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"workload {self.name}: structured must be a StructuredOutput, got {self.structured!r}")
        if self.kind == "code_edit":
            if self.shared_prefix_len:
                raise ValueError(f"workload {self.name}: code_edit takes no shared_prefix_len")
            if not 1 <= self.edit_head_tokens < self.prompt_len[0] // 2:
                raise ValueError(f"workload {self.name}: edit_head_tokens must be in 1..prompt_len/2 - 1, "
                                 f"got {self.edit_head_tokens} for prompt_len {self.prompt_len}")

    @property
    def max_total_tokens(self) -> int:
        """Longest prompt + output of any request (sizes max_seq_len)."""
        return self.shared_prefix_len + self.prompt_len[1] + self.output_len[1]

    @property
    def label(self) -> str:
        return f"{self.name} T={self.temperature:g}" + (f", {self.structured.kind} output" if self.structured else "")

    def with_temperature(self, temperature: float) -> Workload:
        return replace(self, temperature=temperature)

    def constrained(self, spec: StructuredOutput) -> Workload:
        """Same prompts, every request's output following `spec` (ending when it is complete)."""
        return replace(self, structured=spec)

    def with_output_len(self, tokens: int) -> Workload:
        """Same prompts, every request generating exactly `tokens` (quick runs, tests)."""
        return replace(self, output_len=(tokens, tokens))

    def sampling_params(self, index: int, max_tokens: int) -> SamplingParams:
        """Request `index`'s parameters: sampling at the temperature, fixed length (at most
        `max_tokens` under a structured output)."""
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens, ignore_eos=self.structured is None,
                              seed=self.seed * 100_003 + index, structured=self.structured)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", 1, (128, 128), (256, 256),
                   description="one request, 128-token prompt, 256 new tokens"),
    "W2": Workload("W2", 32, (32, 512), (64, 256),
                   description="32 concurrent requests, prompts 32..512, outputs 64..256"),
    "W2-prefix": Workload("W2-prefix", 32, (32, 512), (64, 256), shared_prefix_len=256,
                          description="W2 with a 256-token prefix shared by every prompt"),
    "W5": Workload("W5", 1, (640, 640), (256, 256), kind="code_edit",
                   description="code edit: a source file, then its first lines again; 256 new tokens"),
    "agent": Workload("agent", 16, (384, 384), (96, 96), kind="agent", concurrency=1,
                      description="16 tool-calling requests one after another: the same preamble and answer "
                                  "format, a task each; 96 new tokens each"),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class PromptSet:
    requests: list[RequestSpec]
    source: str  # where the prompt tokens came from (recorded in the results)

    @property
    def expected_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def build_requests(workload: Workload, vocab_size: int, tokenizer: Encoder | None = None) -> PromptSet:
    """The workload's prompts and lengths; deterministic for a (workload, vocab, tokenizer)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = random.Random(workload.seed)
    n = workload.num_requests
    prompt_lens = [rng.randint(*workload.prompt_len) for _ in range(n)]
    output_lens = [rng.randint(*workload.output_len) for _ in range(n)]
    if workload.kind == "code_edit":
        prompts, source = _code_edit_prompts(workload, prompt_lens, vocab_size, tokenizer, rng)
    elif workload.kind == "agent":
        encode = None if tokenizer is None else tokenizer.encode
        prompts, source = agent_prompts(n, workload.prompt_len[1], workload.seed, encode, vocab_size)
    elif tokenizer is None:
        prompts, source = _random_prompts(workload, prompt_lens, vocab_size, rng), f"random ids, seed {workload.seed}"
    else:
        prompts, source = _code_prompts(workload, prompt_lens, tokenizer, rng)
    return PromptSet([RequestSpec(p, m) for p, m in zip(prompts, output_lens, strict=True)], source)


def random_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _random_prompts(workload: Workload, lens: Sequence[int], vocab_size: int, rng: random.Random) -> list[list[int]]:
    prefix = random_ids(rng, vocab_size, workload.shared_prefix_len)
    return [prefix + random_ids(rng, vocab_size, n) for n in lens]


def _code_prompts(workload: Workload, lens: Sequence[int], tokenizer: Encoder,
                  rng: random.Random) -> tuple[list[list[int]], str]:
    """Slices of the code stream; request 0 of a single-request workload starts at the top."""
    need = workload.shared_prefix_len + 4 * max(lens)
    stream, names = code_token_stream(tokenizer, need)
    prefix = stream[:workload.shared_prefix_len]
    body = stream[workload.shared_prefix_len:]
    prompts = []
    for i, n in enumerate(lens):
        start = 0 if i == 0 else rng.randrange(0, len(body) - n + 1)
        prompts.append(prefix + body[start:start + n])
    return prompts, f"code token stream of {len(names)} stdlib file(s) from {names[0]}"


def _code_edit_prompts(workload: Workload, lens: Sequence[int], vocab_size: int, tokenizer: Encoder | None,
                       rng: random.Random) -> tuple[list[list[int]], str]:
    head = workload.edit_head_tokens
    if tokenizer is None:
        prompts = []
        for n in lens:
            body = random_ids(rng, vocab_size, n - head)
            prompts.append(body + body[:head])
        return prompts, f"random ids repeated (body + its first {head} tokens), seed {workload.seed}"
    files = _eligible_files(tokenizer, max(lens))
    prompts, names = [], []
    for i, n in enumerate(lens):
        name, text = files[i % len(files)]
        prompts.append(tokenizer.encode(code_edit_text(text, tokenizer, n, head)))
        names.append(name)
    return prompts, "code edit of stdlib file(s) " + ", ".join(names)


def code_edit_text(text: str, tokenizer: Encoder, budget: int, head_tokens: int) -> str:
    """The file's first whole lines within `budget` tokens, a newline, then its first lines
    again (at least `head_tokens` tokens of them): the continuation repeats the body."""
    lines = text.splitlines(keepends=True)
    head_lines = 1
    while head_lines < len(lines) and _count(tokenizer, "".join(lines[:head_lines])) < head_tokens:
        head_lines += 1
    head = "".join(lines[:head_lines])
    room = budget - _count(tokenizer, head) - 1
    lo, hi = head_lines, len(lines)  # largest line count whose text fits in `room` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count(tokenizer, "".join(lines[:mid])) <= room:
            lo = mid
        else:
            hi = mid - 1
    body = "".join(lines[:lo])
    return body + ("" if body.endswith("\n") else "\n") + "\n" + head


def _count(tokenizer: Encoder, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _eligible_files(tokenizer: Encoder, budget: int) -> list[tuple[str, str]]:
    """Code files long enough that the body fills the budget (so the repeat is long)."""
    found: list[tuple[str, str]] = []
    for name, text in code_files():
        if len(text) >= budget and _count(tokenizer, text) >= budget + 64:
            found.append((name, text))
            if len(found) == 4:
                break
    if not found:
        raise ValueError(f"no source file has {budget + 64} tokens for the code-edit workload: "
                         "lower the workload's prompt_len")
    return found


def code_token_stream(tokenizer: Encoder, min_tokens: int) -> tuple[list[int], list[str]]:
    """Concatenated encodings of code files (sorted order) until `min_tokens` are reached."""
    stream: list[int] = []
    names: list[str] = []
    for name, text in code_files():
        stream += tokenizer.encode(text)
        names.append(name)
        if len(stream) >= min_tokens:
            return stream, names
    raise ValueError(f"the code corpus holds only {len(stream)} tokens, {min_tokens} needed")


@functools.lru_cache(maxsize=1)
def code_files() -> tuple[tuple[str, str], ...]:
    """(relative name, text) of the demo corpus's validation files, sorted by name."""
    root = stdlib_root()
    paths = split_corpus(root).valid
    out = []
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        try:
            out.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    if not out:
        raise FileNotFoundError(f"no readable .py files under {root} for code prompts")
    return tuple(out)
