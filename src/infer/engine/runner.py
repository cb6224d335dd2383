"""ModelRunner: runs the target model for a scheduled step, with or without speculation.

`step(prefill, decode)`: prefill chunks (one request, a batch packed into one row, or
chunks of long prompts after a cached prefix; all one code path through `BatchLayout`),
then one decode step for the running requests. When no request drafts this step, its
decode rows ride along with the prefill chunks in one packed forward instead (`_mixed`,
`EngineConfig.mixed_batches`). A decode step:

1. depths: how deep each request drafts (`Speculation.depths`: the policy's K cut by the
   length guards; 0 for every request without speculation). Depth 0 everywhere is a plain
   decode step: one forward, the sampled tokens [B] stay on the device;
2. propose: the proposer drafts over the round's shape (a chain of up to K, or the static
   tree), no node deeper than the request's depth;
3. verify: one target forward over every draft block, then the verifier
   (`engine/verification.py`), one host sync;
4. accept: the accepted path's K/V rows move into sequence order (a tree's; a chain's are in
   place), the target's cache and the proposer's state roll back to n + a + 1, and the
   tokens are emitted one by one, so a stop inside an accepted run ends the request there.

Sampling lives in the sampling pipeline (`infer.sampling`), called from here for prefill
and plain steps and from the verifier for rounds; the OutputProcessor accepts the ids
(finishes that depend on ids) and renders them (detokenization, stop strings).

Overlapped scheduling (`async_scheduling`, on by default on a GPU): a plain step's tokens
stay on the device (`engine/inflight.py`, the step in flight) and feed the next step's
input ids; the host accepts and renders step n's tokens after queuing step n+1, so the
host's work hides under the GPU's. A round accepts its own tokens (its proposals read the
previous tokens), and renders the tokens accepted before it while its verification runs.
Steps whose sampling needs the tokens on the host (penalties over the context,
log-probabilities) wait for the step in flight first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from infer.cache.compaction import PathMove, move_paths
from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.executor.factory import LOCAL, Executor
from infer.engine.executor.kernels import step_kernels
from infer.engine.executor.spec import ForwardSpec
from infer.engine.inflight import InFlight, TokenBuffers
from infer.engine.kv_manager import KVManager
from infer.engine.output import OutputProcessor, StepRender
from infer.engine.request import Request, StepOutput
from infer.engine.speculation import Speculation, decode_shapes
from infer.engine.verification import Paths, Verification
from infer.logprobs import TokenLogprobs, token_logprobs
from infer.models.eagle import EagleHead
from infer.models.kernels import EAGER
from infer.models.llama import LlamaForCausalLM
from infer.sampling import (NO_TOKEN, SamplingParams, draw_uniforms, greedy_tokens, logits_to_probs,
                            sample_from_probs, temperature_only)
from infer.speculative.faults import isolated, mark_fault
from infer.speculative.forward import ForwardFn
from infer.speculative.grammar_mask import grammar_masked
from infer.speculative.metrics import SpecStats
from infer.speculative.round_clock import StepKind
from infer.speculative.tree import Draft
from infer.speculative.verifier import VerifyResult
from infer.tokenization import Tokenizer
from infer.transfer import tensor_on, to_device

StepResult = list[tuple[Request, StepOutput]]
Sampled = tuple[list[Request], torch.Tensor, list[TokenLogprobs | None]]  # requests, tokens [B] on the device


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer | None, config: EngineConfig,
                 eos_token_ids: tuple[int, ...], executor: Executor = LOCAL,
                 draft_model: LlamaForCausalLM | None = None, head: EagleHead | None = None) -> None:
        self.model = model
        self.config = config
        self.executor = executor  # builds pools and forward functions (on every rank, tensor-parallel)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache_pool = executor.make_pool(model, config, prefix_caching=bool(config.enable_prefix_caching))
        self.output = OutputProcessor(tokenizer, eos_token_ids, config.max_seq_len)
        self.kernels = step_kernels(config, self.device, model)
        shapes, modes = decode_shapes(config)
        # decode and verification steps (with temperature sampling captured for plain steps)
        self.forward: ForwardFn = executor.make_forward(model, self.cache_pool, ForwardSpec(
            config.use_cuda_graphs, config.max_batch_size, shapes=shapes, kernels=self.kernels, verify_modes=modes,
            sample_widths=(1,), sampling_batch_max=config.cuda_graph_sampling_batch_max))
        # prefill chunks: eager, through the same kernel bundle (compiled for dynamic shapes:
        # a chunk's RMSNorm, SwiGLU and residual add one kernel each, the rotary and the cache
        # write one Triton kernel, the projections cuBLAS)
        self.prefill_forward = executor.make_forward(model, self.cache_pool,
                                                     ForwardSpec(max_batch_size=config.max_batch_size,
                                                                 kernels=self.kernels))
        self.speculation: Speculation | None = None
        self.verification: Verification | None = None
        if config.use_speculative_decoding:
            drafter = draft_model if draft_model is not None else head  # (None: n-gram or prompt lookup)
            draft_kernels = EAGER if drafter is None else step_kernels(config, self.device, drafter)
            self.speculation = Speculation.build(config, executor, draft_model, draft_kernels, head, model)
            self.speculation.start(self.forward, self.cache_pool, model)
            self.verification = Verification(self.forward, model.config.vocab_size, self.device,
                                             self.speculation.tree)
        # overlapped scheduling: a step's tokens stay on the device until the next step is queued
        # (on by default on GPUs: under tensor parallelism the next step's message and launch
        # then overlap the step in flight on every rank)
        self.overlap = (config.async_scheduling if config.async_scheduling is not None
                        else self.device.type == "cuda")
        self._inflight: InFlight | None = None
        self._token_buffers = TokenBuffers(2 * config.max_batch_size, self.device)  # prefill and decode rows
        self._time: Callable[[], float] = time.perf_counter
        self._planned: list[int] | None = None  # this step's draft depths, decided before its launch
        self._step_kind: StepKind | None = None  # this step's, for the round clock
        # eager forwards of several rows run their valid tokens packed, and a step with prefill
        # chunks and plain decode rows makes one such forward; not when an EAGLE head reads the
        # target's hidden states (it reads them by padded batch row)
        self.packs = model.capture is None
        self.mixed = config.mixed_batches and self.packs

    @property
    def stats(self) -> SpecStats | None:
        """Speculation counters (None without speculation)."""
        return None if self.speculation is None else self.speculation.stats

    def kv_manager(self) -> KVManager:
        """The scheduler's KV manager over this runner's pools (the proposer's registered)."""
        widths = None if self.speculation is None else self.speculation.decode_widths
        kv = KVManager(self.cache_pool, bool(self.config.enable_prefix_caching), widths)
        if self.speculation is not None:
            kv.register(self.speculation)
        return kv

    def forget(self, request: Request) -> None:
        """A finished request leaves: drop its output state (its memory: `KVManager.release`)."""
        if request.is_finished:
            self.output.release(request.request_id)

    # -- step ------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        """Whether a step is in flight or accepted tokens wait to be rendered."""
        return self._inflight is not None or self.output.num_accepted() > 0

    @torch.inference_mode()
    def step(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request],
             room: Sequence[int] | None = None) -> StepResult:
        """Run a scheduled step; returns the StepOutputs rendered now. Synchronously: this
        step's. Overlapped: the step in flight's tokens are accepted once this step's GPU work
        is queued (the host works while the GPU does), so outputs come one step late. `room`:
        the KV positions the scheduler reserved for each decode row (None: a full round's)."""
        clock = None if self.speculation is None else self.speculation.clock
        start = self._time()
        self._step_kind = None
        # with speculation, each row's draft depth is decided before anything is queued
        self._planned = self.speculation.depths(decode, room) if self.speculation is not None and decode else None
        if self._inflight is not None and not self._overlaps(prefill, decode):
            self._resolve()  # the host needs that step's tokens before this one
        render = StepRender(self.output)
        launched = self._launch(prefill, decode, render)
        self._resolve()
        self._inflight = launched
        if not self.overlap:
            self._resolve()
        # (overlapped, a round's own tokens are rendered under the next step's GPU work)
        outputs = render.finish(render_new=not (self.overlap and self.speculation is not None))
        if clock is not None:
            clock.stepped(start, None if prefill else self._step_kind)
        return outputs

    def _overlaps(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> bool:
        """Whether this step may be queued before the host has the step in flight's tokens:
        not when a round drafts (its proposals read them), nor when a request's sampling reads
        its context (penalties) or its grammar's state, or returns log-probabilities, nor for
        a prefill chunk of a request with a token in flight."""
        if any(self._planned or ()):
            return False
        requests = [*decode, *(r for r, _ in prefill)]
        return not any(r.sampling_params.penalized or r.sampling_params.logprobs is not None or r.grammar is not None
                       for r in requests) and not any(r.pending_tokens for r, _ in prefill)

    def _launch(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request],
                render: StepRender) -> InFlight | None:
        """Queue this step's work; the tokens it samples stay on the device (None: no token
        left in flight, the runner accepted its own)."""
        parts: list[Sampled] = []
        if prefill and decode and self.mixed and self._plain_step(decode):
            self._planned = None
            parts.append(self._mixed(prefill, decode))
        else:
            if prefill:
                sampled = self._prefill(prefill)
                if sampled is not None:
                    parts.append(sampled)
            if decode:
                tokens = self._decode(decode, render)
                if tokens is not None:
                    parts.append(tokens)
        if not parts:
            return None
        requests = [r for reqs, _, _ in parts for r in reqs]
        tokens = torch.cat([tok for _, tok, _ in parts]) if len(parts) > 1 else parts[0][1]
        return InFlight.launch(requests, tokens, self._token_buffers, [lp for _, _, lps in parts for lp in lps])

    def _resolve(self) -> None:
        """Accept the tokens of the step in flight (if any). A request that finished meanwhile
        (aborted, or a finish learnt a step late) drops its token: a wasted row, never a
        wrong token."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        for r, t, lp in zip(inflight.requests, inflight.host_tokens(), inflight.logprobs, strict=True):
            r.pending_tokens -= 1
            if not r.is_finished and r.stop_pending is None:
                self._emit(r, t, lp)

    def _prefill(self, chunks: Sequence[tuple[Request, int]]) -> Sampled | None:
        requests = [r for r, _ in chunks]
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [n for _, n in chunks], packed=self.packs and len(chunks) > 1)
        logits = self.run_chunks(requests, layout)  # [B, V]
        if self.speculation is not None:  # host work for the first proposals, under the forward
            self.speculation.proposer.observed(requests, layout.start_positions,
                                               [range(n) for _, n in chunks])
            self.speculation.proposer.prefilled(requests)
        to_sample = self._advance_chunks(chunks)
        if not to_sample:
            return None
        sampled = [requests[i] for i in to_sample]
        # (the rows by a device index: a list index would copy it over synchronously, and the
        # host would wait for this forward before preparing the next step)
        rows = logits if len(sampled) == len(requests) else logits.index_select(
            0, tensor_on(to_sample, logits.device, torch.long))  # [n, V]
        tokens = self.sample(sampled, rows)  # [n] on the device
        return sampled, tokens, self.logprobs(sampled, rows, tokens)

    def _advance_chunks(self, chunks: Sequence[tuple[Request, int]]) -> list[int]:
        """Count the chunks as computed; the indices of those that end their prompt and sample
        its first token now (their prompts registered for prefix caching)."""
        to_sample: list[int] = []
        for i, (request, n) in enumerate(chunks):
            request.num_computed_tokens += n
            if request.in_prefill:
                continue
            if not request.output_token_ids and not request.pending_tokens:
                to_sample.append(i)
            self.cache_pool.register_prefix(request.slot, request.prompt_token_ids)
        return to_sample

    def run_chunks(self, requests: Sequence[Request], layout: BatchLayout) -> torch.Tensor:
        """Forward chunks of each request's token list through the pool; logits of each row's last token."""
        return self.prefill_forward(self._chunk_ids(requests, layout), layout, all_logits=False)

    @staticmethod
    def _chunk_ids(requests: Sequence[Request], layout: BatchLayout, first: int = 0) -> torch.Tensor:
        """CPU ids [B, T] of the layout's chunks of each request's token list (rows before
        `first` left 0: the caller fills them)."""
        ids = torch.zeros((len(requests), layout.width), dtype=torch.long)
        for b in range(first, len(requests)):
            start, n = layout.start_positions[b], layout.chunk_lens[b]
            ids[b, :n] = torch.tensor(requests[b].token_slice(start, start + n))
        return ids

    def _mixed(self, chunks: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> Sampled:
        """Plain decode rows (first, one token each) and prefill chunks in one packed forward
        (eager, as prefill is); samples the decode rows and the chunks that end their prompt.
        Their tokens stay on the device, as a plain step's."""
        requests = [*decode, *(r for r, _ in chunks)]
        d = len(decode)
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [1] * d + [n for _, n in chunks], packed=True)
        ids = self._chunk_ids(requests, layout, first=d)  # [B, T]
        newest = self._decode_ids(decode)  # [D, 1], on the device when a step is in flight
        ids = to_device(ids, newest.device)
        ids[:d, :1] = newest
        logits = self.prefill_forward(ids, layout, all_logits=False)  # [B, V]
        if self.speculation is not None:
            self.speculation.proposer.observed(requests, layout.start_positions,
                                               [[0]] * d + [range(n) for _, n in chunks])
            self.speculation.proposer.prefilled(requests[d:])
        for r in decode:
            r.num_computed_tokens += 1
        rows = [*range(d), *(d + i for i in self._advance_chunks(chunks))]
        sampled = [requests[i] for i in rows]
        tokens = self.sample(sampled, logits[rows])  # [n] on the device
        return sampled, tokens, self.logprobs(sampled, logits[rows], tokens)

    def _plain_step(self, requests: Sequence[Request]) -> bool:
        """Whether no request drafts this step (its depths planned by `step`)."""
        return not any(self._planned or ())

    def _decode(self, requests: Sequence[Request], render: StepRender) -> Sampled | None:
        """A decode step: a plain one (its tokens left in flight), or a speculation round (its
        tokens accepted now: None; the backlog is rendered while its verification runs)."""
        spec = self.speculation
        depths, self._planned = self._planned, None
        if spec is None or depths is None or not any(depths):
            self._step_kind = StepKind(len(requests), 0)
            return self._plain(requests)
        drafts = spec.proposer.propose(requests, spec.shape(depths), depths)
        if not any(d.num_proposed for d in drafts):  # no proposals at all (n-gram found no match)
            for r, k in zip(requests, depths, strict=True):
                if k:
                    spec.policy.update(r.request_id, 0, 0)
            return self._plain(requests)  # (a synchronous plain step: not timed)
        self._step_kind = StepKind(len(requests), max(d.depth for d in drafts))
        assert self.verification is not None
        result, paths = self.verification.run(requests, drafts, render.backlog)
        self._accept(requests, drafts, result, paths)
        return None

    def _accept(self, requests: Sequence[Request], drafts: Sequence[Draft], result: VerifyResult,
                paths: Paths) -> None:
        """Move the accepted paths into sequence order and roll the caches back, record
        metrics, accept the tokens in order (up to a finish their ids decide: EOS, a stop id,
        the length)."""
        spec = self.speculation
        assert spec is not None
        move_paths(self.cache_pool, [PathMove(r.slot, r.num_computed_tokens, tuple(p))
                                     for r, p in zip(requests, paths, strict=True) if r.slot is not None])
        spec.proposer.on_accepted(requests, paths)
        spec.proposer.observed(requests, [r.num_computed_tokens for r in requests],
                               [[0, *(1 + i for i in p)] for p in paths])
        logprobs = result.logprobs or [[] for _ in requests]
        for r, d, tokens, a, row_lps in zip(requests, drafts, result.tokens, result.num_accepted, logprobs,
                                            strict=True):
            if r.is_finished:  # cut by a stop string rendered under this round: a wasted row
                continue
            n = r.num_computed_tokens
            self.cache_pool.truncate_to(r.slot, n + a + 1)
            r.num_computed_tokens = n + a + 1
            spec.policy.update(r.request_id, d.depth, a)
            if d.depth > 0:
                r.speculation_acceptance_rates.append(a / d.depth)
            emitted = 0
            for j, t in enumerate(tokens):
                self._emit(r, t, row_lps[j] if row_lps else None)
                emitted += 1
                if r.stop_pending is not None or r.fault is not None:
                    break
            r.spec_rounds += 1
            r.spec_tokens_emitted += emitted
            spec.stats.record(d.num_proposed, a, emitted, d.depth)

    def _emit(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Accept one token for a request: its grammar (if any) advances over it first. A
        fault of the request (a NO_TOKEN: its logits gave no distribution; an error in its
        grammar or its rendering) fails it alone: the engine finishes it after the step."""
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

    def _plain(self, requests: Sequence[Request]) -> Sampled:
        """One batched decode forward; the sampled tokens [B] stay on the device."""
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [1] * len(requests))
        ids = self._decode_ids(requests)  # [B, 1]
        params = [r.sampling_params for r in requests]
        vocab = self.model.config.vocab_size
        lps: list[TokenLogprobs | None] = [None] * len(requests)
        if not all(p.greedy for p in params) and all(temperature_only(p, vocab) and p.logprobs is None
                                                     and p.structured is None for p in params):
            # temperature sampling alone: the forward function samples too (inside the step's
            # CUDA graph on the GPU), the same function as `sample` on the logits
            uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]  # [B] CPU
            tokens, _ = self.forward.sample(ids, layout, [1.0 if p.greedy else p.temperature for p in params],
                                            uniforms, [p.greedy for p in params])  # [B]
        else:
            logits = self.forward(ids, layout, all_logits=False)  # [B, V]
            tokens = self.sample(requests, logits, params)
            lps = self.logprobs(requests, logits, tokens)
        if self.speculation is not None:
            self.speculation.proposer.observed(requests, [r.num_computed_tokens for r in requests],
                                               [[0]] * len(requests))
        for r in requests:
            r.num_computed_tokens += 1
        return list(requests), tokens, lps

    def _decode_ids(self, requests: Sequence[Request]) -> torch.Tensor:
        """[B, 1] each decoding request's newest token: on the device, from the step in flight
        (overlapped scheduling), or from the host."""
        inflight = self._inflight
        return (inflight.input_ids(requests) if inflight is not None
                else torch.tensor([[r.last_token_id] for r in requests]))

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
        """One token per request from logits [B, V] with each request's params (the requests'
        own unless the caller has them listed already) and generator: [B] on the device. A
        request with a structured output samples from the tokens its grammar allows."""
        params = [r.sampling_params for r in requests] if params is None else params
        logits = grammar_masked(logits, requests)
        if all(p.greedy and not p.penalized for p in params):
            return greedy_tokens(logits)
        contexts = [r.all_token_ids for r in requests] if any(p.penalized for p in params) else None
        probs = logits_to_probs(logits, params, contexts)
        uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]
        return sample_from_probs(probs, to_device(uniforms, probs.device))
