"""ModelRunner: runs the target model for a scheduled step, with or without speculation.

`step(prefill, decode, room)` runs one flat forward over the prefill chunks, the decode rows and each round's
verification block, then accepts: a tree's accepted K/V move into sequence order, caches roll back to n + a + 1,
tokens are emitted in order. docs/architecture.md, "One engine step"; docs/speculation.md, "Rounds in flight".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from infer.cache.compaction import PathMove, move_paths
from infer.cache.forward_batch import DeviceIds, Row, plan_batch
from infer.engine.executor.factory import LOCAL, Executor
from infer.engine.executor.kernels import step_kernels
from infer.engine.executor.forward import sample_logits
from infer.engine.executor.spec import ForwardSpec
from infer.engine.inflight import InFlight, RoundInFlight, TokenBuffers
from infer.engine.kv_manager import KVManager
from infer.engine.output import OutputProcessor, StepRender
from infer.engine.parts import ResolvedConfig
from infer.engine.request import Request, StepOutput
from infer.engine.speculation import Speculation
from infer.engine.verification import Follows, Paths, Verdict, Verification
from infer.logprobs import TokenLogprobs, token_logprobs
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER
from infer.models.llama import LlamaForCausalLM
from infer.models.medusa import MedusaHead
from infer.sampling import (NO_TOKEN, SamplingParams, draw_uniforms, greedy_tokens, logits_to_probs,
                            sample_from_probs, temperature_only)
from infer.speculative.eagle import EagleProposer
from infer.speculative.faults import isolated, mark_fault
from infer.speculative.forward import ForwardFn
from infer.speculative.grammar_mask import grammar_masked
from infer.speculative.metrics import SpecStats
from infer.speculative.policy import StepKind
from infer.speculative.tree import Draft
from infer.speculative.verifier import VerifyResult
from infer.speculative.vocab_map import VocabMap
from infer.tokenization import Tokenizer
from infer.transfer import to_device

StepResult = list[tuple[Request, StepOutput]]
Sampled = tuple[list[Request], torch.Tensor, list[TokenLogprobs | None]]  # requests, tokens [B] on the device


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer | None, config: ResolvedConfig,
                 eos_token_ids: tuple[int, ...], executor: Executor = LOCAL,
                 draft_model: LlamaForCausalLM | None = None, head: EagleHead | None = None,
                 vocab_map: VocabMap | None = None, medusa: MedusaHead | None = None) -> None:
        self.model = model
        self.config = config
        self.executor = executor  # builds pools and forward functions (on every rank, tensor-parallel)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        execution, batch = config.execution, config.scheduler.max_batch_size
        self.cache_pool = executor.make_pool(model, config.cache, prefix_caching=config.cache.prefix_caching)
        self.output = OutputProcessor(tokenizer, eos_token_ids, config.scheduler.max_seq_len)
        self.kernels = step_kernels(execution, self.device, model)
        # every step's rows in one flat batch; CUDA graphs by token count on a GPU
        spec = ForwardSpec(execution.use_cuda_graphs, batch, kernels=self.kernels, tokens=batch * config.max_row_tokens,
                           trees=config.speculative is not None and config.speculative.tree is not None)
        self.forward_fn: ForwardFn = executor.make_forward(model, self.cache_pool, spec)
        self.forward = self.forward_fn.run
        self.speculation: Speculation | None = None
        self.verification: Verification | None = None
        if config.speculative is not None:
            # the model that drafts (None: n-gram or prompt lookup)
            drafter = draft_model if draft_model is not None else head if head is not None else medusa
            draft_kernels = EAGER if drafter is None else step_kernels(execution, self.device, drafter)
            self.speculation = Speculation.build(config, executor, draft_model, draft_kernels, head, model, vocab_map,
                                                 medusa)
            self.speculation.start(self.forward_fn, self.cache_pool, model)
            self.verification = Verification(model.config.vocab_size, self.device, self.speculation.tree)
        # overlapped scheduling: a step's tokens stay on the device until the next step is queued
        self.overlap = execution.async_scheduling
        self._inflight: InFlight | None = None
        self._round: RoundInFlight | None = None  # a round whose verdict the host has not read
        self._settled: float | None = None  # tokens a decode row got from the round settled this step
        self._token_buffers = TokenBuffers(2 * batch, self.device)  # prefill and decode rows
        self._time: Callable[[], float] = time.perf_counter
        self._planned: list[int] | None = None  # this step's draft depths, decided before its launch
        self._step_kind: StepKind | None = None  # this step's, for the round clock
        self.mixed = config.scheduler.mixed_batches  # prefill chunks and decode rows in one forward (else one each)

    @property
    def stats(self) -> SpecStats | None:
        """Speculation counters (None without speculation)."""
        return None if self.speculation is None else self.speculation.stats

    def kv_manager(self) -> KVManager:
        """The scheduler's KV manager over this runner's pools, the proposer's registered."""
        widths = None if self.speculation is None else self.speculation.decode_widths
        kv = KVManager(self.cache_pool, self.config.cache.prefix_caching, widths)
        if self.speculation is not None:
            kv.register(self.speculation)
            head = self.speculation.proposer
            if kv.prefix_caching and isinstance(head, EagleProposer):  # (its prompt blocks cached too)
                head.share_prefixes()
                self.speculation.restorer = head
                kv.register_restorer(self.speculation)  # (the head's, for requests that may draft)
        return kv

    def forget(self, request: Request) -> None:
        """Drop a finished request's output and speculation-policy state (memory: `KVManager.release`)."""
        if request.is_finished:
            self.output.release(request.request_id)
            if self.speculation is not None:
                self.speculation.forget(request)

    # -- step ------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        """Whether a step is in flight or accepted tokens wait to be rendered."""
        return self._inflight is not None or self._round is not None or self.output.num_accepted() > 0

    @torch.inference_mode()
    def step(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request],
             room: Sequence[int] | None = None) -> StepResult:
        """Run a scheduled step -> the StepOutputs rendered now (overlapped: one step late).
        `room`: the KV positions reserved for each decode row (None: a full round's)."""
        clock = None if self.speculation is None else self.speculation.clock
        start = self._time()
        self._step_kind, self._settled = None, None
        self._planned = self.speculation.depths(decode, room) if self.speculation is not None and decode else None
        if self._inflight is not None and not self._overlaps(prefill, decode):
            self._resolve()  # the host needs that step's tokens before this one
        if self._round is not None and not self._follows(prefill, decode):
            spec = self.speculation
            assert spec is not None
            widths = room if room is not None else [spec.width(spec.spec_length)] * len(decode)
            self._settle(self._round, followed=False, keep={id(r): w for r, w in zip(decode, widths, strict=True)})
        render = StepRender(self.output)
        launched = self._launch(prefill, decode, render)
        self._resolve()
        self._inflight = launched
        if not self.overlap:
            self._resolve()
        # (overlapped, a round's own tokens are rendered under the next step's GPU work)
        outputs = render.finish(render_new=not (self.overlap and self.speculation is not None))
        if clock is not None:
            kind = self._step_kind
            if kind is not None and kind.k:  # (a round's sample weighs it by the tokens a row got;
                # a round deferred with none settled this step: not a sample)
                kind = None if self._settled is None else replace(kind, tokens=self._settled)
            clock.stepped(start, None if prefill else kind)
        return outputs

    def _follows(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> bool:
        """Whether this step's round can be queued behind the round in flight before its
        verdict is read: same requests in order, no prefill, every row's k drafted ahead."""
        flight, planned, spec = self._round, self._planned, self.speculation
        assert flight is not None and spec is not None
        return (not prefill and planned is not None and len(decode) == len(flight.requests)
                and all(a is b for a, b in zip(decode, flight.requests, strict=True))
                and all(k == flight.k for k in planned) and spec.can_follow(decode, flight.k))

    def _overlaps(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> bool:
        """Whether this step may be queued before the host has the step in flight's tokens
        (not with drafts, penalties, a grammar, logprobs, or a prefill of a request with a token in flight)."""
        if any(self._planned or ()):
            return False
        requests = [*decode, *(r for r, _ in prefill)]
        return not any(r.sampling_params.penalized or r.sampling_params.logprobs is not None or r.grammar is not None
                       for r in requests) and not any(r.pending_tokens for r, _ in prefill)

    def _launch(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request],
                render: StepRender) -> InFlight | None:
        """Queue the drafts and the step's forward(s); sampled tokens stay on the device
        (None: no token left in flight)."""
        depths = self._planned if self._planned is not None else [0] * len(decode)
        self._planned = None
        drafts = self._propose(decode, depths) if any(depths) else None
        if decode and (drafts is not None or not any(depths)):  # (a round that found nothing: not timed)
            self._step_kind = StepKind(len(decode), 0 if drafts is None else max(d.depth for d in drafts))
        passes = [(prefill, decode)] if self.mixed or not (prefill and decode) else [(prefill, []), ([], decode)]
        parts = [part for chunks, rows in passes for part in self._pass(chunks, rows, drafts if rows else None,
                                                                          render)]
        if not parts:
            return None
        requests = [r for reqs, _, _ in parts for r in reqs]
        tokens = torch.cat([tok for _, tok, _ in parts]) if len(parts) > 1 else parts[0][1]
        return InFlight.launch(requests, tokens, self._token_buffers, [lp for _, _, lps in parts for lp in lps])

    def _propose(self, decode: Sequence[Request], depths: Sequence[int]) -> list[Draft] | None:
        """The round's drafts (None when nothing was proposed at all: n-gram tables found no match)."""
        spec = self.speculation
        assert spec is not None
        drafts = spec.proposer.propose(decode, spec.shape(depths), depths)
        if any(d.num_proposed for d in drafts):
            return drafts
        for r, k in zip(decode, depths, strict=True):
            if k:
                spec.policy.update(r.request_id, 0, 0)
        return None

    def _pass(self, chunks: Sequence[tuple[Request, int]], decode: Sequence[Request], drafts: list[Draft] | None,
              render: StepRender) -> list[Sampled]:
        """One forward of the decode rows (or a round's blocks) then the prefill chunks; then
        sampling or verification."""
        if not chunks and not decode:
            return []
        flight, self._round = self._round, None  # (still set here: this round follows it, `_follows`)
        follows = None if drafts is None or flight is None else Follows.of(flight.verdict.packed)
        block = None if drafts is None else self._verifier.block(decode, drafts, follows)
        if follows is not None:
            self._spec.stats.followed += 1
        samples = [not r.output_token_ids and not r.pending_tokens and r.num_computed_tokens + n >= r.prefill_target
                   for r, n in chunks]
        rows, device_ids = (block.rows, block.device_ids) if block is not None else self._plain_rows(decode)
        rows = rows + [Row(r.slot, r.num_computed_tokens, r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n),
                           int(s)) for (r, n), s in zip(chunks, samples, strict=True)]
        plan = plan_batch(rows)
        logits = self.forward(plan, device_ids)  # [M, V]
        starts = plan.arrays["query_start"].tolist()
        self._observe(decode, chunks, starts, plain=block is None)
        self._advance_chunks(chunks)
        sampled = [r for (r, _), s in zip(chunks, samples, strict=True) if s]
        if block is None:
            for r in decode:
                r.num_computed_tokens += 1
            requests = [*decode, *sampled]
            return [self._sampled(requests, logits)] if requests else []
        used = block.num_logits
        spec = self.speculation
        assert spec is not None and drafts is not None
        verdict = self._verifier.queue(decode, drafts, block, logits[:used],
                                       lambda packed: spec.verifying(decode, drafts, starts, packed))
        deferred = verdict is not None and self._defer(decode, drafts, verdict, starts)
        if flight is not None:  # (under this round's GPU work; its block kept, counted or not)
            self._settle(flight, followed=True, keep={id(r): 0 if deferred else flight.k + 1 for r in decode})
        if verdict is None:  # (the general pipeline: its host work waits for the logits)
            result, paths = self._verifier.general(decode, drafts, block, logits[:used], render.backlog)
            self._note(self._accept(decode, drafts, result, paths, starts), len(decode))
            return [self._sampled(sampled, logits[used:])] if sampled else []
        render.backlog()
        if not deferred:
            result, paths = self._verifier.collect(verdict)
            self._note(self._accept(decode, drafts, result, paths, starts), len(decode))
        return [self._sampled(sampled, logits[used:])] if sampled else []

    def _note(self, emitted: int, rows: int) -> None:
        self._settled = emitted / rows if rows else None

    def _defer(self, decode: Sequence[Request], drafts: Sequence[Draft], verdict: Verdict,
               starts: Sequence[int]) -> bool:
        """Leave a round of chains in flight when the next round can follow it on the device:
        each row counted as if all k drafts were accepted (k + 1 pending) until `_settle`."""
        k = drafts[0].num_proposed
        spec = self.speculation
        if not self.overlap or spec is None or k == 0 or verdict.block.frame is not None \
                or any(d.num_proposed != k for d in drafts):
            return False
        for r in decode:
            r.num_computed_tokens += k + 1
            r.pending_tokens += k + 1
        if spec.can_follow(decode, k):
            self._round = RoundInFlight(list(decode), list(drafts), verdict, list(starts), k)
            return True
        for r in decode:
            r.num_computed_tokens -= k + 1
            r.pending_tokens -= k + 1
        return False

    def _settle(self, flight: RoundInFlight, followed: bool, keep: dict[int, int]) -> None:
        """Read the round in flight's verdict and accept it: counts corrected, caches cut keeping
        keep[id(request)] positions past (`followed`: positions the next round wrote; else reserved
        room), tokens emitted. A preempted row only takes its tokens."""
        if flight is self._round:
            self._round = None
        spec = self.speculation
        assert spec is not None
        result, paths = self._verifier.collect(flight.verdict)
        k = flight.k
        live = []
        for b, (r, a) in enumerate(zip(flight.requests, result.num_accepted, strict=True)):
            r.pending_tokens -= k + 1
            if r.slot is not None and not r.is_finished:
                r.num_computed_tokens -= k - a
                self._cut(r, r.num_computed_tokens, keep.get(id(r), 0), written=followed)
                live.append(b)
        requests = [flight.requests[b] for b in live]
        spec.on_accepted(requests, [paths[b] for b in live])
        if not followed:
            spec.observed(requests, [r.num_computed_tokens - result.num_accepted[b] - 1 for r, b in
                                     zip(requests, live, strict=True)],
                          [[flight.starts[b], *(flight.starts[b] + 1 + i for i in paths[b])] for b in live])
        self._note(self._emit_round(flight.requests, flight.drafts, result), len(flight.requests))

    @property
    def _spec(self) -> Speculation:
        assert self.speculation is not None
        return self.speculation

    @property
    def _verifier(self) -> Verification:
        assert self.verification is not None
        return self.verification

    def _plain_rows(self, decode: Sequence[Request]) -> tuple[list[Row], DeviceIds | None]:
        """One row per decode request: its newest token, from the device when still in flight."""
        inflight = self._inflight
        if inflight is None:
            return [Row(r.slot, r.num_computed_tokens, [r.last_token_id]) for r in decode], None
        ids = inflight.input_ids(decode)[:, 0]  # [D] on the device
        return ([Row(r.slot, r.num_computed_tokens, [0]) for r in decode],
                DeviceIds(tuple(range(len(decode))), ids, grid=(1, 0, 1)))

    def _observe(self, decode: Sequence[Request], chunks: Sequence[tuple[Request, int]], starts: list[int],
                 plain: bool) -> None:
        """Tell the proposer which of this forward's tokens committed and which prompts were prefilled."""
        if self.speculation is None:
            return
        spec, d = self.speculation, len(decode)
        reqs = [*(decode if plain else ()), *(r for r, _ in chunks)]
        rows = [[starts[b]] for b in range(d)] if plain else []
        rows += [list(range(starts[d + i], starts[d + i] + n)) for i, (_, n) in enumerate(chunks)]
        if reqs:
            spec.observed(reqs, [r.num_computed_tokens for r in reqs], rows)
        if chunks:
            spec.prefilled([r for r, _ in chunks])

    def _advance_chunks(self, chunks: Sequence[tuple[Request, int]]) -> None:
        """Count the chunks as computed; a prompt computed to its end is offered to the prefix cache."""
        for request, n in chunks:
            request.num_computed_tokens += n
            if not request.in_prefill:
                self.cache_pool.register_prefix(request.slot, request.prompt_token_ids)

    def _sampled(self, requests: Sequence[Request], logits: torch.Tensor) -> Sampled:
        """A token per request from logits [B, V] (left on the device), with logprobs where asked."""
        params = [r.sampling_params for r in requests]
        vocab = self.model.config.vocab_size
        if not all(p.greedy for p in params) and all(temperature_only(p, vocab) and p.logprobs is None
                                                     and p.structured is None for p in params):
            uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]  # [B] CPU
            tokens, _ = sample_logits(logits, [1.0 if p.greedy else p.temperature for p in params], uniforms,
                                      [p.greedy for p in params])
            return list(requests), tokens, [None] * len(requests)
        tokens = self.sample(requests, logits, params)
        return list(requests), tokens, self.logprobs(requests, logits, tokens)

    def _resolve(self) -> None:
        """Accept the step in flight's tokens; a request finished meanwhile drops its token."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        for r, t, lp in zip(inflight.requests, inflight.host_tokens(), inflight.logprobs, strict=True):
            r.pending_tokens -= 1
            if not r.is_finished and r.stop_pending is None:
                self._emit(r, t, lp)

    def _cut(self, request: Request, length: int, keep: int, written: bool) -> None:
        """The request's cache cut to `length` positions and `keep` more (`written`: positions
        a queued pass wrote, kept as they are; else room only)."""
        assert request.slot is not None
        self.cache_pool.truncate_to(request.slot, length + keep if written else length)
        if keep and not written and not self.cache_pool.ensure_capacity(request.slot, length + keep):
            raise RuntimeError(f"request {request.request_id}: the room reserved for its step was lost")

    def _accept(self, requests: Sequence[Request], drafts: Sequence[Draft], result: VerifyResult,
                paths: Paths, starts: Sequence[int]) -> int:
        """Move accepted paths into sequence order, roll caches back, emit the tokens -> the
        count emitted. starts[b]: where request b's block begins in the forward's tokens."""
        spec = self.speculation
        assert spec is not None
        move_paths(self.cache_pool, [PathMove(r.slot, r.num_computed_tokens, tuple(p))
                                     for r, p in zip(requests, paths, strict=True) if r.slot is not None])
        spec.on_accepted(requests, paths)
        spec.observed(requests, [r.num_computed_tokens for r in requests],
                      [[s, *(s + 1 + i for i in p)] for s, p in zip(starts, paths, strict=False)])
        for r, a in zip(requests, result.num_accepted, strict=True):
            if not r.is_finished:  # (cut by a stop string rendered under this round: a wasted row)
                n = r.num_computed_tokens
                self.cache_pool.truncate_to(r.slot, n + a + 1)
                r.num_computed_tokens = n + a + 1
        return self._emit_round(requests, drafts, result)

    def _emit_round(self, requests: Sequence[Request], drafts: Sequence[Draft], result: VerifyResult) -> int:
        """Emit a verified round's tokens in order, each row's up to its finish, and record
        metrics -> the tokens emitted. A row already finished is wasted."""
        spec = self.speculation
        assert spec is not None
        logprobs = result.logprobs or [[] for _ in requests]
        total = 0
        for r, d, tokens, a, row_lps in zip(requests, drafts, result.tokens, result.num_accepted, logprobs,
                                            strict=True):
            if r.is_finished or r.stop_pending is not None:
                continue
            emitted = 0
            for j, t in enumerate(tokens):
                self._emit(r, t, row_lps[j] if row_lps else None)
                emitted += 1
                if r.stop_pending is not None or r.fault is not None:
                    break
            total += emitted
            if not spec.drafts_for(r):  # (a plain row of the round: no speculation to count)
                continue
            depth = d.depth
            spec.policy.update(r.request_id, depth, a)
            if depth > 0:
                r.speculation_acceptance_rates.append(a / depth)
            r.spec_rounds += 1
            r.spec_tokens_emitted += emitted
            spec.stats.record(d.num_proposed, a, emitted, depth)
        return total

    def _emit(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Accept one token (the grammar advances first). A fault (NO_TOKEN, a grammar or
        rendering error) fails this request alone; the engine finishes it after the step."""
        if request.fault is not None:
            return
        if token_id == NO_TOKEN:
            mark_fault(request, f"request {request.request_id} failed: its logits were not finite or allowed no "
                                "token (check its temperature, logit_bias, penalties and structured output)")
            return
        with isolated(request, "accepting a token"):
            if request.grammar is not None:
                request.grammar.accept(token_id)
            self.output.accept(request, token_id, logprobs)

    @staticmethod
    def logprobs(requests: Sequence[Request], logits: torch.Tensor, tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        """Log-probabilities of the sampled tokens (logits [B, V], tokens [B]) for requests
        asking for them (a host sync; such steps do not overlap)."""
        wanted = [r.sampling_params.logprobs for r in requests]
        if all(w is None for w in wanted):
            return [None] * len(requests)
        return token_logprobs(logits, tokens.tolist(), wanted)

    def sample(self, requests: Sequence[Request], logits: torch.Tensor,
               params: Sequence[SamplingParams] | None = None) -> torch.Tensor:
        """One token per request from logits [B, V] with its params and generator -> [B] on
        the device; a structured output samples from the tokens its grammar allows."""
        params = [r.sampling_params for r in requests] if params is None else params
        logits = grammar_masked(logits, requests)
        if all(p.greedy and not p.penalized for p in params):
            return greedy_tokens(logits)
        contexts = [r.all_token_ids for r in requests] if any(p.penalized for p in params) else None
        probs = logits_to_probs(logits, params, contexts)
        uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]
        return sample_from_probs(probs, to_device(uniforms, probs.device))
