"""Random engine configurations and workloads for the differential fuzzer (helpers/fuzz.py).

`draw_case(seed, index, avoid)` is a pure function of its arguments: the same (seed, index)
gives the same `Case` on any machine, so one failing case reruns alone. A case is the
`LLM` keywords (its draft named by role: "self" is the target, "random" an unrelated
draft, "near" the target with noise, "eagle" / "eagle3" / "medusa" heads; helpers/fuzz_models.py
makes them) and the requests of one `generate`: prompts sharing prefixes, greedy and
sampled rows (seeds, temperature, top-k / top-p, penalties, log-probabilities, `n`, stops,
max_tokens, per-request `speculation`); one in eight an EAGLE head's greedy chains, overlapped
(rounds in flight). Some cases are invalid on purpose: a configuration `EngineConfig` must refuse
(`invalid`: words its ValueError names) or a prompt `generate` must refuse (`bad_prompt`).
`avoid` names features left out while their known bugs are open (`FEATURES`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields, replace
from typing import Any

from infer import SamplingParams
from infer.engine.config import SUFFIX_TREE

VOCAB = 384  # the tiny checkpoints' vocabulary (helpers.checkpoints.TARGET_VOCAB); 0 = BOS, 1 = EOS
DRAFTS = ("self", "random", "near", "foreign")
HEADS = ("eagle", "eagle3")  # (EAGLE heads: their own KV cache, shared prompt blocks)
STOP_TEXTS = ("e", " t", "a", "th", "o ", ".", "in")
# features a caller can leave out of the drawn cases (a known bug's trigger)
FEATURES = {
    "spec-tight-pool": "speculation with a KV pool only just larger than the largest request",
    "dynamic-tree": "spec_tree='dynamic:N[:B]'",
    "spec-prefix-preemption": "speculation with prefix caching and a pool small enough to preempt",
    "bad-prompt": "a refused prompt beside valid ones in one generate",
    "eagle-prefix-cache": "an EAGLE head with prefix caching",
    "async-preemption": "overlapped scheduling with a pool small enough to preempt",
    "adaptive-preemption": "the adaptive policy with a pool small enough to preempt",
    "draft-tree-alone": "the alone check of seeded sampled rows under a draft model's static tree",
    "suffix": "speculative_method='suffix' (suffix tries, the cache of finished outputs)",
}
# invalid combinations and the words EngineConfig's ValueError must contain
INVALID: tuple[tuple[dict[str, Any], str], ...] = (
    (dict(kv_cache_backend="contiguous", enable_prefix_caching=True), "enable_prefix_caching"),
    (dict(kv_cache_backend="contiguous", num_blocks=8), "num_blocks"),
    (dict(use_speculative_decoding=True, speculative_method="ngram", spec_tree="2,1", spec_policy="adaptive",
          spec_cost_coefficient=0.0), "spec_policy"),
    (dict(use_speculative_decoding=True, speculative_method="ngram", spec_tree="2,1", spec_length=3), "spec_length"),
    (dict(use_speculative_decoding=True, speculative_method="ngram", spec_tree="dynamic:4"), "draft model"),
    (dict(use_speculative_decoding=False, spec_tree="2,1"), "use_speculative_decoding"),
    (dict(use_speculative_decoding=True, speculative_method="eagle3", draft="none"), "draft_model"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(use_speculative_decoding=True, speculative_method="ngram", spec_length=0), "spec_length"),
    (dict(kv_cache_backend="paged", num_blocks=0), "num_blocks"),
    (dict(use_speculative_decoding=True, spec_tree="dynamic:0", draft="near"), "spec_tree"),
    (dict(use_speculative_decoding=True, speculative_method="medusa", draft="none"), "draft_model"),
    (dict(use_speculative_decoding=True, speculative_method="medusa", draft="medusa", spec_length=7), "spec_length"),
    (dict(speculative_method="suffix", spec_tree="2,1"), "grows its own trees"),
    (dict(speculative_method="suffix", spec_length=4, spec_suffix_max_depth=4), "spec_suffix_max_depth"),
    (dict(speculative_method="ngram", spec_suffix_cache_tokens=0), "spec_suffix_cache_tokens"),
)


@dataclass(frozen=True)
class Job:
    """One prompt of the workload and its sampling parameters."""

    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    engine: dict[str, Any]  # LLM keywords; "draft": a draft's role (DRAFTS, HEADS) or absent;
    #                         "draft_vocab": True for the models' reduced draft vocabulary
    jobs: tuple[Job, ...]
    invalid: str | None = None  # words the construction's ValueError must contain; None: valid
    bad_prompt: tuple[int, ...] | None = None  # a prompt generate must refuse (sent with the jobs)
    abort: tuple[int, int] | None = None  # (job, engine step): the job aborted then, in a last pass
    avoid: frozenset[str] = field(default_factory=frozenset)

    @property
    def speculative(self) -> bool:
        return bool(self.engine.get("use_speculative_decoding"))


def draw_case(seed: int, index: int, avoid: frozenset[str] = frozenset()) -> Case:
    """Case `index` of the run seeded `seed` (module docstring)."""
    unknown = set(avoid) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
    rng = random.Random(f"infer-fuzz:{seed}:{index}")
    jobs = _draw_jobs(rng)
    engine = _draw_engine(rng, jobs, avoid)
    invalid = None
    if rng.random() < 0.06:  # one invalid setting or combination, on an otherwise default engine
        mutation, invalid = rng.choice(INVALID)
        engine = {k: v for k, v in {"max_seq_len": engine["max_seq_len"], **mutation}.items() if v != "none"}
    bad = None
    if "bad-prompt" not in avoid and invalid is None and rng.random() < 0.05:
        bad = rng.choice([(), (0, VOCAB + rng.randrange(100)), (0, -1), (0,) * (engine["max_seq_len"] + 1)])
    abort = (rng.randrange(len(jobs)), rng.randint(0, 8)) if rng.random() < 0.3 else None
    jobs = _with_speculation(random.Random(f"infer-fuzz:{seed}:{index}:speculation"), jobs, engine)
    if invalid is None and not avoid & {"eagle-prefix-cache", "async-preemption", "spec-tight-pool",
                                        "spec-prefix-preemption"}:
        engine, jobs = _in_flight(random.Random(f"infer-fuzz:{seed}:{index}:in-flight"), engine, jobs)
    return Case(seed, index, engine, tuple(jobs), invalid, bad, abort, frozenset(avoid))


def _in_flight(rng: random.Random, engine: dict[str, Any], jobs: list[Job]) -> tuple[dict[str, Any], list[Job]]:
    """One case in eight made one whose rounds stay in flight (docs/speculation.md): an EAGLE
    head's chains, overlapped, every row greedy without log-probabilities, at the engine's K
    (drawn from a generator of its own, so the rest of a case is what it was before)."""
    if rng.random() >= 0.125 or engine.get("use_speculative_decoding") and engine["speculative_method"] not in HEADS:
        return engine, jobs
    engine = {k: v for k, v in engine.items() if k not in ("spec_tree", "spec_policy", "spec_cost_coefficient")}
    method = engine.get("speculative_method") if engine.get("use_speculative_decoding") else rng.choice(HEADS)
    engine.update(use_speculative_decoding=True, speculative_method=method, draft=method, async_scheduling=True,
                  spec_length=engine.get("spec_length") or rng.randint(1, 6))
    greedy = [replace(j, params=replace(j.params, temperature=0.0, seed=None, logprobs=None, speculation=None))
              for j in jobs]
    return engine, greedy


def _with_speculation(rng: random.Random, jobs: list[Job], engine: dict[str, Any]) -> list[Job]:
    """Each job's `SamplingParams.speculation` (drawn from a generator of its own, so the rest
    of a case is what it was before the field existed): None (the engine's policy), False,
    or a K up to the engine's spec_length when it speculates."""
    limit = (engine.get("spec_length") or 1) if engine.get("use_speculative_decoding") else None
    out = []
    for job in jobs:
        draw = rng.random()
        value = None if draw < 0.5 else False if draw < 0.75 or limit is None else rng.randint(1, limit)
        out.append(replace(job, params=replace(job.params, speculation=value)))
    return out


def _draw_prompts(rng: random.Random, count: int) -> list[tuple[int, ...]]:
    """Prompts from three families: random ids, a repeated motif (n-gram matches) and
    extensions of a shared start (prefix-cache hits, duplicates)."""
    shared = [0] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(3, 24))]
    out = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.35:
            prompt = [0] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 28))]
        elif kind < 0.6:
            motif = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))]
            prompt = [0] + motif * rng.randint(2, 8)
        else:
            prompt = shared[:rng.randint(1, len(shared))] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(0, 8))]
        out.append(tuple(prompt))
    return out


def _draw_jobs(rng: random.Random) -> list[Job]:
    count = rng.choice([1, 1, 2, 3, 4, 4, 5, 6, 8, 10])
    return [Job(p, _draw_params(rng, p)) for p in _draw_prompts(rng, count)]


def _draw_params(rng: random.Random, prompt: tuple[int, ...]) -> SamplingParams:
    kw: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 3, 5, 8, 12, 16, 20, 24, 32, 40]),
                          "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.45:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.0, 1.5, 2.0])
        kw["seed"] = rng.randrange(2**31) if rng.random() < 0.85 else None
    if rng.random() < 0.2:
        kw["top_k"] = rng.choice([1, 2, 5, 20, 100])
    if rng.random() < 0.2:
        kw["top_p"] = rng.choice([0.3, 0.6, 0.9, 0.99])
    if rng.random() < 0.2:
        kw["repetition_penalty"] = rng.choice([0.8, 1.1, 1.3, 2.0])
    if rng.random() < 0.15:
        kw["presence_penalty"] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.15:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.3, 1.0])
    if rng.random() < 0.25:
        kw["logprobs"] = rng.choice([0, 1, 3, 5])
    if rng.random() < 0.2:
        kw["n"] = rng.randint(2, 4)
    if rng.random() < 0.15:
        kw["stop_token_ids"] = tuple(rng.choice(prompt + (1,)) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.12:
        kw["stop"] = tuple(rng.sample(STOP_TEXTS, rng.randint(1, 2)))
    return SamplingParams(**kw)


def _draw_engine(rng: random.Random, jobs: list[Job], avoid: frozenset[str]) -> dict[str, Any]:
    need = max(len(j.prompt) + j.params.max_tokens for j in jobs)
    kw: dict[str, Any] = {"max_seq_len": rng.choice([256, need, need + rng.randint(1, 8)]),
                          "max_batch_size": rng.choice([1, 2, 3, 4, 8, 16]),
                          "max_num_batched_tokens": rng.choice([1, 2, 3, 5, 8, 16, 64, 512]),
                          "seed": rng.randrange(100)}
    if rng.random() < 0.3:
        kw["mixed_batches"] = False
    if rng.random() < 0.5:
        kw["async_scheduling"] = rng.random() < 0.5
    if rng.random() < 0.7:
        _draw_speculation(rng, kw, avoid)
    if rng.random() < 0.25:
        kw["kv_cache_backend"] = "contiguous"
        kw["enable_prefix_caching"] = False
    else:
        _draw_paged(rng, kw, need, jobs)
    _leave_out(kw, need, jobs, avoid)
    return kw


def _draw_speculation(rng: random.Random, kw: dict[str, Any], avoid: frozenset[str]) -> None:
    methods = ["draft_model", "draft_model", "draft_model", "ngram", "prompt_lookup", "eagle", "eagle3", "medusa"]
    method = rng.choice(methods + ([] if "suffix" in avoid else ["suffix"]))
    kw.update(use_speculative_decoding=True, speculative_method=method, spec_length=rng.randint(1, 6))
    if method == "draft_model":
        kw["draft"] = rng.choice(DRAFTS)
        if rng.random() < 0.2:
            kw["draft_vocab"] = True  # the models' reduced draft vocabulary (`spec_draft_vocab`)
    elif method in (*HEADS, "medusa"):
        kw["draft"] = method
    elif method == "suffix":
        _draw_suffix(rng, kw)
        return
    tree = rng.random()
    if tree < 0.2:
        widths = [rng.randint(1, 3) for _ in range(rng.randint(1, 4))]
        kw["spec_tree"] = ",".join(map(str, widths))
        kw["spec_length"] = len(widths)
    elif tree < 0.35 and method == "draft_model" and "dynamic-tree" not in avoid:
        kw["spec_tree"] = _dynamic_tree(rng)
    elif rng.random() < 0.35:
        kw["spec_policy"] = "adaptive"
        kw["spec_cost_coefficient"] = rng.choice([0.0, 0.05, 0.2, 0.6])
    if rng.random() < 0.1:
        kw["spec_disable_batch_size"] = rng.randint(1, 3)
    if rng.random() < 0.1:  # (timed on the host's clock: rounds switched off and probed)
        kw["spec_batch_gate"] = True


def _dynamic_tree(rng: random.Random) -> str:
    nodes = rng.randint(1, 12)
    return f"dynamic:{nodes}" + (f":{rng.randint(1, min(4, nodes))}" if rng.random() < 0.7 else "")


def _draw_suffix(rng: random.Random, kw: dict[str, Any]) -> None:
    """Suffix decoding: its own dynamic trees (the default's, or drawn), the tries' depth, a
    cache of finished outputs from none to the default's, the probability floor."""
    if rng.random() < 0.6:
        kw["spec_tree"] = _dynamic_tree(rng)
    if rng.random() < 0.5:
        kw["spec_suffix_max_depth"] = kw["spec_length"] + rng.choice([1, 2, 5])
    if rng.random() < 0.6:
        kw["spec_suffix_cache_tokens"] = rng.choice([0, 0, 8, 64])
    if rng.random() < 0.3:
        kw["spec_suffix_min_prob"] = rng.choice([0.0, 0.3, 0.9])
    if rng.random() < 0.1:
        kw["spec_disable_batch_size"] = rng.randint(1, 3)
    if rng.random() < 0.1:  # (timed on the host's clock: rounds switched off and probed)
        kw["spec_batch_gate"] = True


def suffix_cache(kw: dict[str, Any]) -> bool:
    """Whether the case drafts from a cache of finished outputs (suffix decoding's, on by
    default): a seeded row's drafts, so its tokens, then depend on the requests before it."""
    return kw.get("speculative_method") == "suffix" and kw.get("spec_suffix_cache_tokens", 1) > 0


def round_positions(kw: dict[str, Any]) -> int:
    """Positions one speculation round writes past a request's end at most (g and its nodes)."""
    if not kw.get("use_speculative_decoding"):
        return 1
    tree, k = kw.get("spec_tree"), kw.get("spec_length") or 5
    if tree is None and kw.get("speculative_method") == "suffix":
        tree = SUFFIX_TREE
    if tree is None:
        return 1 + k
    if tree.startswith("dynamic"):
        parts = [int(p) for p in tree.split(":")[1:]]
        nodes, branch = parts[0], parts[1] if len(parts) > 1 else min(4, parts[0])
        return 1 + max(nodes, (k - 1) * branch + 1)
    widths = [int(w) for w in tree.split(",")]
    return 1 + sum(math.prod(widths[:d + 1]) for d in range(len(widths)))


def _draw_paged(rng: random.Random, kw: dict[str, Any], need: int, jobs: list[Job]) -> None:
    bs = rng.choice([1, 1, 2, 3, 4, 5, 8, 16])
    kw.update(kv_cache_backend="paged", block_size=bs)
    if rng.random() < 0.3:
        kw["enable_prefix_caching"] = False
    pool = rng.random()
    if pool < 0.45:  # just enough for the largest request, or a bit more
        kw["num_blocks"] = math.ceil(need / bs) + rng.choice([0, 0, 1, 2, 4])
    elif pool < 0.6:  # half of what every sample needs at once
        kw["num_blocks"] = max(math.ceil(need / bs), math.ceil(_tokens(jobs) / bs) // 2)


def _tokens(jobs: list[Job]) -> int:
    return sum(j.params.n * (len(j.prompt) + j.params.max_tokens) for j in jobs)


def _leave_out(kw: dict[str, Any], need: int, jobs: list[Job], avoid: frozenset[str]) -> None:
    """Change a configuration so it shows none of the `avoid` features."""
    speculative = kw.get("use_speculative_decoding", False)
    if "eagle-prefix-cache" in avoid and speculative and kw["speculative_method"] in HEADS:
        kw["enable_prefix_caching"] = False
    if "num_blocks" not in kw:
        return
    bs, width = kw["block_size"], round_positions(kw)
    if "spec-tight-pool" in avoid and speculative:
        kw["num_blocks"] = max(kw["num_blocks"], math.ceil((need + width) / bs) + 1)
    samples = sum(j.params.n for j in jobs)
    if kw["num_blocks"] * bs >= _tokens(jobs) + samples * (bs + width):
        return  # (this pool never preempts)
    if "async-preemption" in avoid:
        kw["async_scheduling"] = False
    if "spec-prefix-preemption" in avoid and speculative:
        kw["enable_prefix_caching"] = False
    if "adaptive-preemption" in avoid and kw.get("spec_policy") == "adaptive":
        del kw["spec_policy"], kw["spec_cost_coefficient"]


def simpler_params(params: SamplingParams) -> list[SamplingParams]:
    """Each one-step simplification of `params` (the shrinker's moves)."""
    defaults = SamplingParams()
    out = []
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name in ("temperature", "max_tokens", "seed", "ignore_eos") or value == getattr(defaults, f.name):
            continue
        out.append(replace(params, **{f.name: getattr(defaults, f.name)}))
    if params.max_tokens > 1:
        out.append(replace(params, max_tokens=max(1, params.max_tokens // 2)))
        out.append(replace(params, max_tokens=params.max_tokens - 1))
    return out


def params_source(params: SamplingParams) -> str:
    """`SamplingParams(...)` with the fields that differ from the defaults."""
    defaults = SamplingParams()
    args = [f"{f.name}={getattr(params, f.name)!r}" for f in fields(SamplingParams)
            if getattr(params, f.name) != getattr(defaults, f.name)]
    return f"SamplingParams({', '.join(args)})"
