"""Shrinking a failing fuzz case to a small repro, and the repro as Python source.

`shrink(case, failure, models, plain)` tries one simplification at a time (drop a job, a
sampling option, half the tokens, an engine option back to its default, a shorter draft)
and keeps it while the case still fails with the same signature, until none applies.
`repro_source` writes the result as a short script (models from helpers/fuzz_models.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from helpers.fuzz_cases import Case, Job, params_source, simpler_params
from helpers.fuzz_checks import Failure, Plain, check_case
from helpers.fuzz_models import FuzzModels

# engine options the shrinker resets (drops); the rest define what the case is
OPTIONAL = ("spec_disable_batch_size", "spec_batch_gate", "async_scheduling", "mixed_batches", "max_batch_size", "seed",
            "enable_prefix_caching", "num_blocks", "max_num_batched_tokens", "spec_tree", "block_size")
MAX_ATTEMPTS = 400


def shrink(case: Case, failure: Failure, models: FuzzModels, plain: Plain) -> Case:
    """The smallest case found that fails with `failure`'s signature."""
    attempts = 0
    progress = True
    while progress and attempts < MAX_ATTEMPTS:
        progress = False
        for candidate in _moves(case):
            attempts += 1
            got = check_case(candidate, models, plain)
            if got is not None and got.signature == failure.signature:
                case, progress = candidate, True
                break
            if attempts >= MAX_ATTEMPTS:
                break
    return case


def _moves(case: Case) -> Iterator[Case]:
    jobs = list(case.jobs)
    if case.abort is not None:
        yield replace(case, abort=None)
    if len(jobs) > 1:
        for i in range(len(jobs)):
            yield _without_job(case, i)
    for i, job in enumerate(jobs):
        for params in simpler_params(job.params):
            yield _with_job(case, i, Job(job.prompt, params))
        if len(job.prompt) > 1:
            yield _with_job(case, i, Job(job.prompt[:max(1, len(job.prompt) // 2)], job.params))
            yield _with_job(case, i, Job(job.prompt[:-1], job.params))
    yield from _engine_moves(case)


def _engine_moves(case: Case) -> Iterator[Case]:
    engine = case.engine
    for key in OPTIONAL:
        if key in engine:
            yield replace(case, engine={k: v for k, v in engine.items() if k != key})
    if engine.get("spec_policy") == "adaptive":
        fixed = {k: v for k, v in engine.items() if k not in ("spec_policy", "spec_cost_coefficient")}
        yield replace(case, engine=fixed)
    if engine.get("max_seq_len", 0) < 256:
        yield replace(case, engine={**engine, "max_seq_len": 256})
    k = engine.get("spec_length", 1)
    if k > 1 and "spec_tree" not in engine:  # (a job's own K at most the new one)
        jobs = tuple(replace(j, params=replace(j.params, speculation=min(j.params.speculation, k - 1)))
                     if j.params.max_drafts else j for j in case.jobs)
        yield replace(case, engine={**engine, "spec_length": k - 1}, jobs=jobs)


def _without_job(case: Case, i: int) -> Case:
    abort = case.abort
    if abort is not None:
        abort = None if abort[0] == i else (abort[0] - (abort[0] > i), abort[1])
    return replace(case, jobs=case.jobs[:i] + case.jobs[i + 1:], abort=abort)


def _with_job(case: Case, i: int, job: Job) -> Case:
    return replace(case, jobs=case.jobs[:i] + (job,) + case.jobs[i + 1:])


def repro_source(case: Case, models_dir: str = "/tmp/infer-fuzz-models") -> str:
    """A script that rebuilds the models and runs the case's generate (PYTHONPATH=src:tests)."""
    engine: dict[str, Any] = {k: v for k, v in case.engine.items() if k not in ("draft", "draft_vocab")}
    args = ", ".join(f"{k}={v!r}" for k, v in engine.items())
    if "draft" in case.engine:
        args += f", draft_model=str(m.draft({case.engine['draft']!r}))"
    if case.engine.get("draft_vocab"):
        args += ", spec_draft_vocab=str(m.vocab_table)"
    prompts = [list(j.prompt) for j in case.jobs] + ([list(case.bad_prompt)] if case.bad_prompt is not None else [])
    text = str(prompts) if case.bad_prompt is None or len(case.bad_prompt) < 16 else (
        f"{prompts[:-1]} + [[{case.bad_prompt[0]}] * {len(case.bad_prompt)}]")
    params = [params_source(j.params) for j in case.jobs] + (
        ["SamplingParams(max_tokens=1)"] if case.bad_prompt is not None else [])
    return "\n".join([
        "from dataclasses import replace",
        "from helpers.fuzz_models import FuzzModels",
        "from infer import LLM, SamplingParams",
        f"m = FuzzModels.build({models_dir!r})",
        f"llm = LLM(str(m.target), device='cpu', {args})",
        f"prompts = {text}",
        f"params = [{', '.join(params)}]",
        "outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)",
        "print([[c.token_ids for c in o.outputs] for o in outs], llm.engine.leak_report())",
    ] + ([] if case.abort is None else [
        "# the abort pass: one sample of each prompt, one aborted at an engine step",
        "reqs = [llm.engine.add_request(p, replace(q, n=1)) for p, q in zip(prompts, params)]",
        f"for step in range(10_000):\n    if step == {case.abort[1]}:\n"
        f"        llm.engine.abort(reqs[{case.abort[0]}].request_id)",
        "    if all(r.is_finished for r in reqs):\n        break\n    llm.engine.step()",
        "print([r.output_token_ids for r in reqs], llm.engine.leak_report())",
    ]))
