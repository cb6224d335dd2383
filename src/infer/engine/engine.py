"""Engine: owns the model(s), the scheduler and the runner; one synchronous `step()`.

`add_request` validates and queues, `abort` frees a request's memory at once, `step` returns
(request, StepOutput) pairs (a request may appear several times per step). With
tensor_parallel_size N > 1 this process is rank 0 and starts N-1 worker ranks; `close()` ends them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from infer.engine.batch_size import context_hint, model_context
from infer.engine.config import EngineConfig
from infer.engine.defaults import resolve_config
from infer.engine.executor.factory import Executor, engine_executor, start_parallel
from infer.engine.loading import Checked, LoadedModels, check_before_loading, load_models, load_part
from infer.engine.request import FinishReason, Request, StepOutput
from infer.engine.runner import ModelRunner, StepResult
from infer.engine.scheduler import Scheduler
from infer.engine.speculation import check_request_speculation
from infer.engine.startup import StartupTimes, TimedExecutor
from infer.engine.threads import apply_cpu_threads
from infer.sampling import SamplingParams, StructuredOutput
from infer.speculative.suffix import SuffixProposer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from infer.engine.structured import Grammars, RequestGrammar

log = logging.getLogger("infer.engine")


class Engine:
    def __init__(self, config: EngineConfig, models: LoadedModels | None = None) -> None:
        """An engine of `config` (left as given: `self.resolved` holds every default decided)."""
        self.config = config
        self._checked: Checked | None = None
        if models is None and config.tensor_parallel_size > 1:
            # the workers read weights as soon as they start: check tokenizer and draft pair first
            self._checked = check_before_loading(load_part(config))
        self.startup = StartupTimes()
        with self.startup.phase("load"):  # (the other ranks start loading their shards now)
            self.parallel = start_parallel(config, models)  # None: one rank, this process
        try:
            self.resolved = resolve_config(config, models)
            with self.startup.phase("load"):
                self.models = models or self._load_models()
            # (the first parameter's device: an integer-weight head has no dense weight)
            self.threads = apply_cpu_threads(self.resolved.load.threads, next(self.models.target.parameters()).device,
                                             sum(p.numel() for p in self.models.target.parameters()))
            self.tokenizer = self.models.tokenizer
            with self.startup.phase("runner"):
                self.runner = self._make_runner()
        except BaseException:
            self.close()
            raise
        log.info(self.startup.summary(self.resolved, self.models.vocab_map))
        self.kv = self.runner.kv_manager()
        self.scheduler = Scheduler(self.resolved.scheduler, self.kv)
        self._ids = itertools.count()
        self._num_added = 0
        self._requests: dict[str, Request] = {}
        self._grammars: Grammars | None = None  # built when a request first asks for a structured output
        self._grammars_lock = threading.Lock()  # (built from whichever thread asks first)

    def _load_models(self) -> LoadedModels:
        context, spec = self.resolved.scheduler.max_seq_len, self.resolved.speculative
        if self.parallel is None:
            return load_models(self.resolved.load, spec, max_seq_len=context)
        load = replace(self.resolved.load, device=self.parallel.device)
        return load_models(load, spec, *self.parallel.shards, max_seq_len=context, checked=self._checked)

    def _make_runner(self) -> ModelRunner:
        executor: Executor = TimedExecutor(engine_executor(self.parallel, self.models, self.resolved.execution),
                                           self.startup)
        drafting = self.resolved.speculative is not None
        return ModelRunner(self.models.target, self.tokenizer, self.resolved, self.models.eos_token_ids, executor,
                           draft_model=self.models.draft if drafting else None,
                           head=self.models.head if drafting else None, vocab_map=self.models.vocab_map,
                           medusa=self.models.medusa if drafting else None)

    def close(self) -> None:
        """Shut the tensor-parallel worker ranks down (idempotent; also done at garbage collection or exit)."""
        if self.parallel is not None:
            self.parallel.close()

    @property
    def vocab_size(self) -> int:
        return self.models.target.config.vocab_size

    @property
    def model_context(self) -> int:
        """The models' own context: max_seq_len goes up to it."""
        draft = [self.models.draft.config] if self.models.draft is not None else []
        return model_context([self.models.target.config, *draft])

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, compiled: CompiledGrammar | None = None) -> Request:
        """Validate and queue a request (ValueError naming what to fix). `compiled`: its structured
        output's grammar compiled elsewhere; None compiles it here."""
        params = sampling_params or SamplingParams()
        ids = list(prompt_token_ids)
        self.validate_prompt(ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        grammar = None if params.structured is None else self.grammar(params.structured, compiled)
        request = Request(rid, ids, params, grammar=grammar)
        if params.seed is None:  # unseeded requests still replay exactly under the same engine seed
            request.generator.manual_seed((self.resolved.load.seed * 1_000_003 + self._num_added) % 2**63)
        self._num_added += 1
        self._requests[rid] = request
        self.scheduler.add(request)
        return request

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """ValueError naming what to fix in a request: its prompt, its length, its `speculation`."""
        self.check_speculation(params)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        limit = self.resolved.scheduler.max_seq_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {len(ids) + params.max_tokens} "
                f"exceeds max_seq_len {limit}: shorten the prompt, lower max_tokens or "
                + context_hint(limit, self.model_context))
        capacity = self.kv_capacity_tokens()
        if capacity is not None and len(ids) + params.max_tokens > capacity:
            raise ValueError(f"prompt + max_tokens needs {len(ids) + params.max_tokens} KV cache tokens but the "
                             f"pool holds {capacity}: raise num_blocks / kv_cache_memory_bytes")

    def check_speculation(self, params: SamplingParams) -> None:
        """ValueError when `params.speculation` asks for more than this engine drafts."""
        spec = self.resolved.speculative
        check_request_speculation(params.speculation, None if spec is None else spec.length)

    def grammar(self, spec: StructuredOutput, compiled: CompiledGrammar | None = None) -> RequestGrammar:
        """A request's grammar state for `spec` (of `compiled`, else compiled once per spec);
        ValueError naming the problem for a bad schema, regex or grammar."""
        return self.grammars.matcher(spec, compiled)

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler for this model's tokenizer (built on first use); ValueError
        when the model has no tokenizer or xgrammar is missing."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer; this engine has none")
                try:
                    from infer.engine.structured import Grammars
                except ImportError as exc:
                    raise ValueError(f"structured outputs need xgrammar ({exc}): pip install "
                                     "'infer-engine[structured]'") from None
                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.models.eos_token_ids)
            return self._grammars

    def kv_capacity_tokens(self) -> int | None:
        return self.kv.capacity_tokens()

    def abort(self, request_id: str) -> StepOutput | None:
        """Cancel a request: its slot and KV blocks are freed now. None if unknown/finished."""
        request = self._requests.pop(request_id, None)
        if request is None or request.is_finished:
            return None
        self.scheduler.remove(request)
        out = self.runner.output.finish_without_token(request, FinishReason.ABORT)
        self.runner.forget(request)
        return out

    def reset_draft_history(self) -> None:
        """Forget what drafting learnt from finished requests (suffix decoding's cache), e.g.
        before each timed benchmark run."""
        proposer = self.runner.speculation.proposer if self.runner.speculation is not None else None
        if isinstance(proposer, SuffixProposer):
            proposer.reset_history()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.runner.has_pending()

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> StepResult:
        decision = self.scheduler.schedule()
        results = self.runner.step(decision.prefill, decision.decode, decision.decode_room)
        results += self._fail_faulted()
        for request in self.scheduler.retire():
            self.runner.forget(request)
            self._requests.pop(request.request_id, None)
        return results

    def _fail_faulted(self) -> StepResult:
        """Finish the requests whose own work failed this step (`Request.fault`) with an error."""
        results: StepResult = []
        for request in [r for r in self._requests.values() if r.fault is not None and not r.is_finished]:
            self.scheduler.remove(request)
            results.append((request, self.runner.output.finish_without_token(request, FinishReason.ERROR,
                                                                            request.fault)))
            self.runner.forget(request)
            self._requests.pop(request.request_id, None)
        return results

    def fail_all(self, message: str) -> StepResult:
        """Finish every request with an error (the loop hit an exception)."""
        results: StepResult = []
        for request in list(self._requests.values()):
            self.scheduler.remove(request)
            results.append((request, self.runner.output.finish_without_token(request, FinishReason.ERROR, message)))
            self.runner.forget(request)
        self._requests.clear()
        return results

    def leak_report(self) -> list[str]:
        problems = [f"request {r} still tracked" for r in self._requests]
        if self.scheduler.has_unfinished():
            problems.append(f"scheduler holds {len(self.scheduler.waiting)} waiting, "
                            f"{len(self.scheduler.running)} running")
        workers = self.parallel.leak_report() if self.parallel is not None else []
        return problems + self.kv.leak_report() + workers

    @property
    def device(self) -> torch.device:
        return self.runner.device
