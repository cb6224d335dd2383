"""ContinuousRunner: runs the target model for a scheduled step.

`step(prefill, decode)`: prefill chunks (one request, a right-padded batch, or chunks of
long prompts after a cached prefix; all one code path through `BatchLayout`) then one
batched decode forward. Sampling goes through the pure sampling pipeline; the OutputProcessor
accepts the sampled ids (finishes that depend on ids) and renders them (detokenization,
stop strings). Returns (request, StepOutput) pairs.

Overlapped scheduling (`async_scheduling`, on by default on a GPU): the sampled tokens stay
on the device (`engine/inflight.py`) and feed the next step's input ids; the host accepts
and renders step n's tokens after queuing step n+1, so the host's work hides under the
GPU's. Steps whose sampling needs the tokens on the host (penalties over the context,
log-probabilities) wait for the step in flight first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.executor import ForwardFn, ForwardSpec
from infer.engine.executor.factory import LOCAL, Executor
from infer.engine.inflight import InFlight, TokenBuffers
from infer.engine.output import OutputProcessor
from infer.engine.request import Request, StepOutput
from infer.models.kernels import EAGER, Kernels, compiled_kernels
from infer.models.llama import LlamaForCausalLM
from infer.logprobs import TokenLogprobs, token_logprobs
from infer.sampling import SamplingParams, draw_uniforms, logits_to_probs, sample_from_probs, temperature_only
from infer.speculative.metrics import SpecStats
from infer.tokenization import Tokenizer
from infer.transfer import to_device

StepResult = list[tuple[Request, StepOutput]]


def step_kernels(config: EngineConfig, device: torch.device, model: LlamaForCausalLM | None = None) -> Kernels:
    """Fused (torch.compile) kernels for decode-type steps of `model` when asked for; by
    default with CUDA graphs on a GPU. Prefill always uses the eager kernels."""
    wanted = config.compile_kernels
    if wanted is None:
        wanted = config.use_cuda_graphs and device.type == "cuda"
    if not wanted:
        return EAGER
    if model is None:
        return compiled_kernels()
    param = next(model.parameters())
    c = model.config
    return compiled_kernels((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                             c.intermediate_size, c.rms_norm_eps, param.dtype, param.device.type))


class ContinuousRunner:
    stats: SpecStats | None = None  # speculation counters (the speculative runner's)

    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer | None, config: EngineConfig,
                 eos_token_ids: tuple[int, ...], executor: Executor = LOCAL) -> None:
        self.model = model
        self.config = config
        self.executor = executor  # builds pools and forward functions (on every rank, tensor-parallel)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache_pool = executor.make_pool(model, config, prefix_caching=bool(config.enable_prefix_caching))
        self.output = OutputProcessor(tokenizer, eos_token_ids, config.max_seq_len)
        self.kernels = step_kernels(config, self.device, model)
        self.forward: ForwardFn = self._make_decode_forward()
        # prefill chunks: eager, the eager kernels (their many shapes never meet compiled ones)
        self.prefill_forward = executor.make_forward(model, self.cache_pool,
                                                     ForwardSpec(max_batch_size=config.max_batch_size))
        # overlapped scheduling: a step's tokens stay on the device until the next step is queued
        # (on by default on GPUs: under tensor parallelism the next step's message and launch
        # then overlap the step in flight on every rank)
        self.overlap = (config.async_scheduling if config.async_scheduling is not None
                        else self.device.type == "cuda")
        self._inflight: InFlight | None = None
        self._token_buffers = TokenBuffers(2 * config.max_batch_size, self.device)  # prefill and decode rows
        self._rendered: StepResult = []  # this step's outputs so far
        self._backlog = 0  # tokens accepted before this step, not rendered yet

    def _make_decode_forward(self) -> ForwardFn:
        # plain decode: width 1, last logits; with temperature sampling captured as well
        return self.executor.make_forward(self.model, self.cache_pool, ForwardSpec(
            self.config.use_cuda_graphs, self.config.max_batch_size, shapes=((1, False),), kernels=self.kernels,
            sample_widths=(1,), sampling_batch_max=self.config.cuda_graph_sampling_batch_max))

    # -- capacity (the scheduler's view) -------------------------------------------------
    def can_admit(self, request: Request) -> bool:
        return self.cache_pool.can_allocate(request.prefill_target)

    def allocate(self, request: Request) -> None:
        prefix = request.prompt_token_ids if self.config.enable_prefix_caching else None
        request.slot = self.cache_pool.allocate_slot(request.prefill_target, prefix)
        request.num_computed_tokens = self.cache_pool.seq_len(request.slot)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        assert request.slot is not None
        return self.cache_pool.ensure_capacity(request.slot, total_tokens)

    def decode_demand(self, request: Request) -> int:
        return 1

    def release(self, request: Request) -> None:
        if request.slot is not None:
            self.free_slot(request.slot)
            request.slot = None
        if request.is_finished:
            self.cleanup_request(request.request_id)

    def free_slot(self, slot_idx: int) -> None:
        self.cache_pool.free_slot(slot_idx)

    def cleanup_request(self, request_id: str) -> None:
        self.output.release(request_id)

    def pools(self) -> list[CachePoolProtocol]:
        """The KV pools this runner's requests hold memory in (the target's; a draft's too)."""
        return [self.cache_pool]

    def leak_report(self) -> list[str]:
        return self.cache_pool.leak_report()

    # -- step ------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        """Whether a step is in flight or accepted tokens wait to be rendered."""
        return self._inflight is not None or self.output.num_accepted() > 0

    @torch.inference_mode()
    def step(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> StepResult:
        """Run a scheduled step; returns the StepOutputs rendered now. Synchronously: this
        step's. Overlapped: the previous step's tokens are accepted once this step's GPU work
        is queued (the host works while the GPU does), so outputs come one step late."""
        if self._inflight is not None and not self._overlaps(prefill, decode):
            self._resolve()  # the host needs that step's tokens before this one
        self._rendered = []
        self._backlog = self.output.num_accepted()
        launched = self._launch(prefill, decode)
        self._resolve()
        self._inflight = launched
        if not self.overlap:
            self._resolve()
        self._render_backlog()
        if not self._defers_render():
            self._rendered += self.output.render()
        return self._rendered

    def _render_backlog(self) -> None:
        """Render the tokens accepted before this step, once: while the GPU runs this step's
        work when the runner calls it after queuing that work, else at the step's end."""
        backlog, self._backlog = self._backlog, 0
        if backlog:
            self._rendered += self.output.render(upto=backlog)

    def _defers_render(self) -> bool:
        """Whether the tokens this step accepted wait for the next step's render (a runner that
        accepts its own step's tokens before returning, overlapped: the speculative one)."""
        return False

    def _overlaps(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> bool:
        """Whether this step may be queued before the host has the step in flight's tokens:
        not when a request's sampling reads its context (penalties) or returns
        log-probabilities, nor for a prefill chunk of a request with a token in flight."""
        return not any(r.sampling_params.penalized or r.sampling_params.logprobs is not None
                       for r in [*decode, *(r for r, _ in prefill)]) and not any(r.pending_tokens for r, _ in prefill)

    def _launch(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> InFlight | None:
        """Queue this step's work; the tokens it samples stay on the device (None: no token
        left in flight, the runner accepted its own)."""
        parts: list[tuple[list[Request], torch.Tensor, list[TokenLogprobs | None]]] = []
        if prefill:
            sampled = self._prefill(prefill)
            if sampled is not None:
                parts.append(sampled)
        if decode:
            tokens = self._decode(decode)
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
                self.output.accept(r, t, lp)

    def _prefill(self, chunks: Sequence[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor, list] | None:
        requests = [r for r, _ in chunks]
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [n for _, n in chunks])
        logits = self.run_chunks(requests, layout)  # [B, V]
        self._prefill_in_flight(requests)
        to_sample: list[int] = []
        for i, (request, n) in enumerate(chunks):
            request.num_computed_tokens += n
            if request.in_prefill:
                continue
            if not request.output_token_ids and not request.pending_tokens:
                to_sample.append(i)
            self.cache_pool.register_prefix(request.slot, request.prompt_token_ids)
        if not to_sample:
            return None
        sampled = [requests[i] for i in to_sample]
        tokens = self.sample(sampled, logits[to_sample])  # [n] on the device
        return sampled, tokens, self.logprobs(sampled, logits[to_sample], tokens)

    def run_chunks(self, requests: Sequence[Request], layout: BatchLayout) -> torch.Tensor:
        """Forward chunks of each request's token list through the pool; logits of each row's last token."""
        ids = torch.zeros((len(requests), layout.width), dtype=torch.long)
        for b, (request, start, n) in enumerate(zip(requests, layout.start_positions, layout.chunk_lens,
                                                    strict=True)):
            ids[b, :n] = torch.tensor(request.token_slice(start, start + n))
        return self.prefill_forward(ids, layout, all_logits=False)

    def _decode(self, requests: Sequence[Request]) -> tuple[list[Request], torch.Tensor, list] | None:
        """One batched decode forward; the sampled tokens [B] stay on the device."""
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [1] * len(requests))
        inflight = self._inflight
        ids = (inflight.input_ids(requests) if inflight is not None
               else torch.tensor([[r.last_token_id] for r in requests]))  # [B, 1]
        params = [r.sampling_params for r in requests]
        vocab = self.model.config.vocab_size
        lps: list[TokenLogprobs | None] = [None] * len(requests)
        if not all(p.greedy for p in params) and all(temperature_only(p, vocab) and p.logprobs is None
                                                     for p in params):
            # temperature sampling alone: the forward function samples too (inside the step's
            # CUDA graph on the GPU), the same function as `sample` on the logits
            uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]  # [B] CPU
            tokens, _ = self.forward.sample(ids, layout, [1.0 if p.greedy else p.temperature for p in params],
                                            uniforms, [p.greedy for p in params])  # [B]
        else:
            logits = self.forward(ids, layout, all_logits=False)  # [B, V]
            tokens = self.sample(requests, logits, params)
            lps = self.logprobs(requests, logits, tokens)
        for r in requests:
            r.num_computed_tokens += 1
        return list(requests), tokens, lps

    def _prefill_in_flight(self, requests: Sequence[Request]) -> None:
        """Host work for requests in prefill, run after the prefill forward is queued and
        before its logits are read (on a GPU it hides under the forward). Nothing here."""

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
        own unless the caller has them listed already) and generator: [B] on the device."""
        params = [r.sampling_params for r in requests] if params is None else params
        if all(p.greedy and not p.penalized for p in params):
            return logits.argmax(dim=-1)
        contexts = [r.all_token_ids for r in requests] if any(p.penalized for p in params) else None
        probs = logits_to_probs(logits, params, contexts)
        uniforms = draw_uniforms([r.generator for r in requests], 1)[:, 0]
        return sample_from_probs(probs, to_device(uniforms, probs.device))
