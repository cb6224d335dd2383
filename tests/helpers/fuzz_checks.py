"""One fuzz case run and checked (helpers/fuzz.py): the first failure, or None.

`check_case(case, models, plain)` builds the case's `LLM` (an invalid configuration must
raise ValueError naming its fields), sends a refused prompt when the case has one (the
ValueError must leave nothing queued), then generates the jobs and checks:
  - no livelock: each generate runs under a step cap (`Watchdog`: engine steps counted,
    never wall time);
  - limits: at most max_tokens tokens, finish reasons that match, no stop id or EOS before
    the end, no stop string in the text, one log-probability entry per token;
  - lossless: greedy rows equal plain decoding of the target (`Plain`, one request alone,
    top-k 1 rows too; every reported log-probability within LOGPROB_ATOL of the target's);
  - rerun: the same generate again on the same engine gives greedy and seeded rows the
    same tokens (seeded rows: where drafting does not depend on the batch or on earlier
    requests, `_repeats`);
  - alone: a seeded sampled row run alone gives its tokens in the batch (likewise);
  - abort: one job aborted at a given engine step (the jobs driven through `Engine`) ends
    as aborted, the other greedy rows keep their tokens;
  - leaks: `engine.leak_report()` is empty after every generate.
A failure's `signature` (kind and place, e.g. an exception's type and innermost frame in
src/infer) groups cases failing the same way.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch
from helpers.fuzz_cases import Case, Job, params_source, suffix_cache
from helpers.fuzz_models import FuzzModels

from infer import LLM, SamplingParams
from infer.engine.output import CompletionOutput
from infer.models.loading.loader import load_model

LOGPROB_ATOL = 1e-3
STEP_FACTOR, STEP_SLACK = 8, 200  # step cap: STEP_FACTOR x (prompt + max_tokens, every sample) + STEP_SLACK
ALONE_ROWS = 2  # seeded sampled rows per case also run alone


@dataclass(frozen=True)
class Failure:
    kind: str  # construct | refusal | livelock | exception | limits | lossless | rerun | alone | abort | leak
    where: str  # the exception's type and innermost engine frame, or what the check compared
    detail: str

    @property
    def signature(self) -> str:
        return f"{self.kind}: {self.where}"


class Livelock(RuntimeError):
    pass


class Watchdog:
    """Counts `engine.step` calls of one LLM; a generate past its cap raises Livelock."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.real_step = llm.engine.step
        self.steps = 0
        self.cap = 0
        llm.engine.step = self._step  # (an instance attribute: LLM._run calls engine.step())

    def arm(self, jobs: list[Job]) -> None:
        self.steps = 0
        self.cap = STEP_FACTOR * sum(j.params.n * (len(j.prompt) + j.params.max_tokens) for j in jobs) + STEP_SLACK

    def _step(self) -> Any:
        self.steps += 1
        if self.steps > self.cap:
            raise Livelock(f"no finish within {self.cap} engine steps "
                           f"({self.engine.scheduler.num_preemptions} preemptions so far)")
        return self.real_step()


class Plain:
    """The references: plain decoding of the target, one request at a time (memoized), and
    the target's log-probabilities of a given continuation (one full forward)."""

    def __init__(self, models: FuzzModels) -> None:
        self.llm = LLM(str(models.target), device="cpu", kv_cache_backend="contiguous", max_batch_size=1,
                       max_seq_len=512)
        self.model = load_model(str(models.target), dtype="float32")[0]
        self.memo: dict[tuple[tuple[int, ...], SamplingParams], CompletionOutput] = {}

    def greedy(self, job: Job) -> CompletionOutput:
        """Plain greedy decoding of the job (a sampled job: with its penalties and stops)."""
        key = (job.prompt, replace(job.params, n=1, seed=None, temperature=0.0, top_k=-1, top_p=1.0,
                                   speculation=None))
        if key not in self.memo:
            outs = self.llm.generate(prompt_token_ids=[list(job.prompt)], sampling_params=key[1])
            self.memo[key] = outs[0].outputs[0]
        return self.memo[key]

    def logprobs(self, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
        """log_softmax of the target's logits at each of `tokens`' positions [len(tokens), V]."""
        ids = torch.tensor([list(prompt) + tokens[:-1]])  # [1, T]
        with torch.no_grad():
            logits = self.model(ids)[0, len(prompt) - 1:]  # [len(tokens), V]
        return torch.log_softmax(logits.float(), dim=-1)


def engine_kwargs(case: Case, models: FuzzModels) -> dict[str, Any]:
    kw = {k: v for k, v in case.engine.items() if k not in ("draft", "draft_vocab")}
    if "draft" in case.engine:
        kw["draft_model"] = str(models.draft(case.engine["draft"]))
    if case.engine.get("draft_vocab"):
        kw["spec_draft_vocab"] = str(models.vocab_table)
    return kw


def check_case(case: Case, models: FuzzModels, plain: Plain) -> Failure | None:
    try:
        llm = _build(case, models)
    except ValueError as exc:
        if case.invalid is not None and case.invalid in str(exc):
            return None
        return Failure("construct", f"ValueError{' (wrong words)' if case.invalid else ''}", str(exc))
    except Exception as exc:  # noqa: BLE001 - every other error is the finding
        return _exception("construct", exc)
    if case.invalid is not None:
        return Failure("construct", "accepted an invalid configuration",
                       f"expected a ValueError naming {case.invalid!r}")
    return _refusal(case, llm) or _generate_checks(case, models, llm, plain)


def _build(case: Case, models: FuzzModels) -> LLM:
    return LLM(str(models.target), device="cpu", **engine_kwargs(case, models))


def _refusal(case: Case, llm: LLM) -> Failure | None:
    if case.bad_prompt is None:
        return None
    prompts = [list(j.prompt) for j in case.jobs] + [list(case.bad_prompt)]
    params = [j.params for j in case.jobs] + [SamplingParams(max_tokens=1)]
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    except ValueError:
        leaks = llm.engine.leak_report()
        return Failure("refusal", "refused prompt left requests behind", str(leaks)) if leaks else None
    except Exception as exc:  # noqa: BLE001
        return _exception("refusal", exc)
    return Failure("refusal", "accepted an invalid prompt", repr(case.bad_prompt))


def _generate(llm: LLM, watchdog: Watchdog, jobs: list[Job], what: str) -> list[list[CompletionOutput]] | Failure:
    watchdog.arm(jobs)
    try:
        outs = llm.generate(prompt_token_ids=[list(j.prompt) for j in jobs], sampling_params=[j.params for j in jobs])
    except Livelock as exc:
        return Failure("livelock", f"{what} ({_setting(llm)})", str(exc))
    except Exception as exc:  # noqa: BLE001
        return _exception(what, exc)
    leaks = llm.engine.leak_report()
    if leaks:
        return Failure("leak", f"{what} ({_setting(llm)})", "; ".join(leaks))
    return [o.outputs for o in outs]


def _generate_checks(case: Case, models: FuzzModels, llm: LLM, plain: Plain) -> Failure | None:
    jobs = list(case.jobs)
    watchdog = Watchdog(llm)
    first = _generate(llm, watchdog, jobs, "batch")
    if isinstance(first, Failure):
        return first
    max_seq_len = llm.engine.resolved.scheduler.max_seq_len
    for i, (job, samples) in enumerate(zip(jobs, first, strict=True)):
        failure = _limits(i, job, samples, llm, max_seq_len) or _lossless(i, job, samples, plain)
        if failure:
            return replace(failure, where=f"{failure.where} ({_setting(llm)})")
    again = _generate(llm, watchdog, jobs, "rerun")
    if isinstance(again, Failure):
        return again
    for i, (job, a, b) in enumerate(zip(jobs, first, again, strict=True)):
        if _repeats(job, case) and _tokens(a) != _tokens(b):
            return Failure("rerun", _row_kind(job, llm), f"job {i}: first {_tokens(a)}, rerun {_tokens(b)}")
    return _alone(case, models, llm, first) or _abort(case, llm, watchdog, plain)


def _alone(case: Case, models: FuzzModels, batch_llm: LLM, batched: list[list[CompletionOutput]]) -> Failure | None:
    """Seeded sampled rows, each alone on a fresh engine of the case's configuration (no
    cached prefix), give their tokens in the batch."""
    if len(case.jobs) == 1 or _batch_dependent(case):
        return None  # (drafting decided by the batch, or by other requests' outputs, changes a seeded row's uniforms)
    tree = case.engine.get("spec_tree")
    if ("draft-tree-alone" in case.avoid and case.engine.get("speculative_method") == "draft_model" and tree
            and not tree.startswith("dynamic")):
        return None
    rows = [i for i, j in enumerate(case.jobs) if j.params.seed is not None and not j.params.greedy][:ALONE_ROWS]
    for i in rows:
        llm = _build(case, models)
        alone = _generate(llm, Watchdog(llm), [case.jobs[i]], "alone")
        if isinstance(alone, Failure):
            return alone
        if _tokens(alone[0]) != _tokens(batched[i]):
            return Failure("alone", _row_kind(case.jobs[i], batch_llm),
                           f"job {i}: batched {_tokens(batched[i])}, alone {_tokens(alone[0])}")
    return None


def _abort(case: Case, llm: LLM, watchdog: Watchdog, plain: Plain) -> Failure | None:
    """One sample of each job, one job aborted at a given engine step: it finishes as
    aborted (unless done by then), the greedy rows keep plain decoding's tokens, nothing leaks."""
    if case.abort is None:
        return None
    victim, at = case.abort
    engine, jobs = llm.engine, [Job(j.prompt, replace(j.params, n=1)) for j in case.jobs]
    watchdog.arm(jobs)
    try:
        requests = [engine.add_request(list(j.prompt), j.params) for j in jobs]
        while any(not r.is_finished for r in requests):
            if watchdog.steps == at:
                engine.abort(requests[victim].request_id)
            engine.step()
    except Livelock as exc:
        return Failure("livelock", f"abort ({_setting(llm)})", str(exc))
    except Exception as exc:  # noqa: BLE001
        return _exception("abort", exc)
    leaks = engine.leak_report()
    if leaks:
        return Failure("leak", f"abort ({_setting(llm)})", "; ".join(leaks))
    for i, (job, request) in enumerate(zip(jobs, requests, strict=True)):
        if i == victim and watchdog.steps > at and request.finish_reason is None:
            return Failure("abort", f"aborted request without a finish reason ({_setting(llm)})", f"job {i}")
        if i != victim and job.params.greedy and request.output_token_ids != plain.greedy(job).token_ids:
            return Failure("abort", f"greedy row changed by another's abort ({_setting(llm)})",
                           f"job {i}: {request.output_token_ids}, plain {plain.greedy(job).token_ids}")
    return None


def _limits(i: int, job: Job, samples: list[CompletionOutput], llm: LLM, max_seq_len: int) -> Failure | None:
    p = job.params
    if len(samples) != p.n:
        return Failure("limits", "n samples", f"job {i}: {len(samples)} samples for n={p.n}")
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(llm.engine.models.eos_token_ids))
    for s in samples:
        problem = _sample_problem(s, p, stops, len(job.prompt) + len(s.token_ids) >= max_seq_len)
        if problem:
            return Failure("limits", problem, f"job {i}: {s.token_ids} {s.finish_reason!r} {s.text!r}")
    return None


def _sample_problem(s: CompletionOutput, p: SamplingParams, stops: set[int], at_seq_end: bool) -> str | None:
    """What is wrong with one sample's length, finish reason, text and log-probabilities."""
    ids, reason = s.token_ids, s.finish_reason
    if not ids or len(ids) > p.max_tokens:
        return "token count outside 1..max_tokens"
    if any(t in stops for t in ids[:-1]):
        return "a stop id or EOS before the last token"
    if reason == "length" and (ids[-1] in stops or not (len(ids) == p.max_tokens or at_seq_end)):
        return "finish 'length' before a limit or at a stop id"
    if reason == "stop" and ids[-1] not in stops and not p.stop:
        return "finish 'stop' without a stop id, EOS or stop string"
    if reason not in ("stop", "length"):
        return f"finish {reason!r}"
    if any(stop in s.text for stop in p.stop):
        return "a stop string in the text"
    if p.logprobs is not None and (s.logprobs is None or len(s.logprobs) != len(ids)
                                   or any(len(lp.top) != p.logprobs for lp in s.logprobs)):
        return "log-probabilities missing or of the wrong shape"
    return None


def _lossless(i: int, job: Job, samples: list[CompletionOutput], plain: Plain) -> Failure | None:
    """Greedy rows (and top-k 1 rows, deterministic too) give plain decoding's tokens; every
    reported log-probability is the target's at its position."""
    deterministic = job.params.greedy or job.params.top_k == 1
    ref = plain.greedy(job) if deterministic else None
    for s in samples:
        if ref is not None and (s.token_ids != ref.token_ids or s.finish_reason != ref.finish_reason):
            row = "greedy" if job.params.greedy else "top-k 1"
            return Failure("lossless", f"{row} tokens", f"job {i}: plain {ref.token_ids} ({ref.finish_reason}), "
                                                        f"engine {s.token_ids} ({s.finish_reason})")
        if s.logprobs and not _logprobs_match(s, plain.logprobs(job.prompt, s.token_ids)):
            return Failure("lossless", "log-probabilities", f"job {i}: tokens {s.token_ids}, reported "
                                                             f"{[round(lp.logprob, 4) for lp in s.logprobs]}")
    return None


def _logprobs_match(sample: CompletionOutput, expected: torch.Tensor) -> bool:
    """Each token's log-probability and its top alternatives' values are the target's."""
    for row, lp in zip(expected, sample.logprobs or [], strict=True):
        top = row.topk(len(lp.top)).values.tolist() if lp.top else []
        if abs(lp.logprob - row[lp.token_id].item()) > LOGPROB_ATOL or any(
                abs(v - w) > LOGPROB_ATOL for (_, v), w in zip(lp.top, top, strict=True)):
            return False
    return True


def _repeats(job: Job, case: Case) -> bool:
    """Whether the job's tokens must be the same in a rerun: greedy rows, and seeded rows
    unless which steps draft depends on the batch or on timing (a rerun's cached prefixes
    change its batches): spec_disable_batch_size, the batch gate, or the adaptive policy,
    whose probes count the steps a request was scheduled plain and whose K a short
    reservation cuts (docs/architecture.md, "What a seed promises"); or suffix decoding
    drafts from the first run's outputs."""
    return job.params.greedy or (job.params.seed is not None and not _batch_dependent(case))


def _batch_dependent(case: Case) -> bool:
    """Whether the case's speculation decides a row's drafting from its batch or timing (or
    from other requests: suffix decoding's cache of finished outputs)."""
    return (case.engine.get("spec_disable_batch_size") is not None or case.engine.get("spec_policy") == "adaptive"
            or case.engine.get("spec_batch_gate") is True or suffix_cache(case.engine))


def _tokens(samples: list[CompletionOutput]) -> list[list[int]]:
    return [s.token_ids for s in samples]


def _row_kind(job: Job, llm: LLM) -> str:
    return f"{'greedy' if job.params.greedy else 'seeded sampled'} row ({_setting(llm)})"


def _setting(llm: LLM) -> str:
    """What may explain a failure: the proposer and policy, prefix caching, preemption, overlap."""
    config = llm.config
    parts = [config.speculative_method if config.use_speculative_decoding else "no speculation"]
    if config.use_speculative_decoding and config.spec_tree:
        parts[0] += ", dynamic tree" if config.spec_tree.startswith("dynamic") else ", static tree"
    if config.use_speculative_decoding and config.spec_policy == "adaptive":
        parts[0] += ", adaptive"
    parts.append("prefix caching" if config.enable_prefix_caching else "no prefix caching")
    parts.append("preempted" if llm.engine.scheduler.num_preemptions else "no preemption")
    if llm.engine.runner.overlap:
        parts.append("overlapped")
    return "; ".join(parts)


def _exception(what: str, exc: BaseException) -> Failure:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/infer/" in f.filename.replace("\\", "/")]
    frame = ours[-1] if ours else frames[-1] if frames else None
    place = f"{frame.filename.rsplit('/infer/', 1)[-1]}:{frame.name}" if frame else "?"
    return Failure("exception", f"{type(exc).__name__} at {place} ({what})", f"{exc}")


def describe(case: Case, failure: Failure) -> str:
    """The case and its failure, as printed by the test and the command line."""
    jobs = "\n".join(f"    ({list(j.prompt)}, {params_source(j.params)})," for j in case.jobs)
    return (f"{failure.signature}\n  {failure.detail}\n  engine: {case.engine}\n  jobs:\n{jobs}"
            + (f"\n  refused prompt: {_short(case.bad_prompt)}" if case.bad_prompt is not None else "")
            + (f"\n  expected ValueError naming {case.invalid!r}" if case.invalid else "")
            + (f"\n  abort: job {case.abort[0]} at engine step {case.abort[1]}" if case.abort else ""))


def _short(prompt: tuple[int, ...]) -> str:
    return f"[{prompt[0]}] * {len(prompt)}" if len(prompt) > 8 and len(set(prompt)) == 1 else str(list(prompt))
