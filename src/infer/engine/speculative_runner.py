"""SpeculativeRunner: propose -> verify -> accept -> roll back (spec D1, D3-D6, D9).

Prefill is the ContinuousRunner's (target only; the draft prefills lazily). A decode step:

1. the policy picks k per request (fixed K or adaptive), cut by the length guards (no
   position past max_seq_len, no more drafts than the request can still emit); a batch
   larger than `spec_disable_batch_size` decodes plainly;
2. the proposer drafts up to k tokens per request (draft model: K batched draft steps, one
   CUDA graph replay on the GPU; n-gram: table lookups);
3. one batched target forward over [g, t_1..t_k] per request (g: the pending token),
   written to the target cache like a chunked prefill at positions n..n+k;
4. rejection sampling accepts a prefix of each draft and adds one recovered or bonus token;
5. both caches are truncated to n + a + 1 tokens; the tokens are emitted one by one through
   the OutputProcessor, so a stop inside an accepted run ends the request there.

A step where nobody drafts (every k = 0, or no proposal at all) is exactly the plain
decode step. Batches whose rows sample with a temperature alone (greedy included) verify
through the forward function's `verify` (`rejection.verify_logits`; a CUDA graph on the
GPU); rows with top-k, top-p or a repetition penalty take the general pipeline
(`logits_to_probs`, then `rejection.verify`), and so do batches with a request asking for
log-probabilities (`infer.logprobs`: the target's, at each emitted position).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.executor import ForwardFn, ForwardSpec
from infer.engine.executor.factory import LOCAL, Executor
from infer.engine.request import Request
from infer.engine.runner import ContinuousRunner, StepResult, step_kernels
from infer.engine.step_costs import StepCostConfig, measure_spec_costs, weight_bytes
from infer.models.llama import LlamaForCausalLM
from infer.logprobs import emitted_logprobs
from infer.sampling import logits_to_probs, round_uniforms, temperature_only
from infer.speculative.draft_model import CATCH_UP_CHUNK, DRAFT_MAX_FEED, DraftModelProposer
from infer.speculative.metrics import SpecStats
from infer.speculative.ngram import NgramConfig, NgramProposer
from infer.speculative.policy import AdaptiveConfig, AdaptivePolicy, FixedPolicy, SpecPolicy
from infer.speculative.proposer import Draft, Proposer
from infer.speculative.rejection import VerifyResult, unpack_rows, verify
from infer.speculative.round_clock import RoundClock, StepKind
from infer.tokenization import Tokenizer
from infer.transfer import to_device

# the adaptive policy's one-off cost measurement at start (GPU): timed calls per shape
COST_REPEATS, COST_WARMUP = 10, 3


def stack_draft_probs(probs: Sequence[torch.Tensor | None], tokens: torch.Tensor, counts: Sequence[int], vocab: int,
                      device: torch.device) -> torch.Tensor | None:
    """[B, W, V] draft distributions on `device` for rows of `counts[b]` drafted tokens (of
    `tokens`: [B, W] host): `probs[b]` ([counts[b], V]) where the draft reported one, a
    one-hot row per token where it is deterministic; None when every row is (all one-hot q)."""
    if all(p is None for p in probs):
        return None
    b, width = tokens.shape
    out = torch.zeros((b, width, vocab), dtype=torch.float32, device=device)
    for i, (p, k) in enumerate(zip(probs, counts, strict=True)):
        if p is not None:
            out[i, :k] = p
        elif k:
            out[i, torch.arange(k), tokens[i, :k]] = 1.0
    return out


def guard_k(k: int, seq_len: int, max_seq_len: int, tokens_left: int) -> int:
    """Overflow guard: positions seq_len..seq_len+k must fit; no more drafts than can be emitted."""
    return max(0, min(k, max_seq_len - seq_len - 1, tokens_left - 1))


class SpeculativeRunner(ContinuousRunner):
    draft_loop_rounds = True  # a draft model's rounds as `draft_loop` graphs (not the tree runner's)

    def __init__(self, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM | None,
                 tokenizer: Tokenizer | None, config: EngineConfig, eos_token_ids: tuple[int, ...],
                 executor: Executor = LOCAL) -> None:
        super().__init__(target_model, tokenizer, config, eos_token_ids, executor)
        self.spec_length = config.spec_length
        self.stats = SpecStats()
        self.draft: DraftModelProposer | None = None
        self.proposer: Proposer = self._make_proposer(draft_model)
        self.policy: SpecPolicy = self._make_policy()
        # the adaptive policy's wall-clock view of a round (not when the user gave c: taken as is)
        self.clock = (RoundClock(self.policy.round_cost) if isinstance(self.policy, AdaptivePolicy)
                      and config.spec_cost_coefficient is None else None)
        self._time: Callable[[], float] = time.perf_counter
        self._planned: list[int] | None = None  # this step's draft lengths, when decided before its launch
        self._step_kind: StepKind | None = None  # this step's, for the clock

    def _make_decode_forward(self) -> ForwardFn:
        # verification: widths 1..K+1 (k varies per round with the policy and the overflow guard);
        # plain decode (every k = 0) reuses the ContinuousRunner path: width 1, last logits,
        # temperature sampling captured too. The acceptance step is captured too: greedy
        # batches, one-hot drafts (n-gram, greedy draft rows) and, for a draft model, its
        # probabilities
        verify = [(w, True) for w in range(1, self.config.spec_length + 2)]
        modes = ("greedy", "one_hot") + (("draft_probs",) if self.config.speculative_method == "draft_model" else ())
        return self.executor.make_forward(self.model, self.cache_pool, ForwardSpec(
            self.config.use_cuda_graphs, self.config.max_batch_size, shapes=(*verify, (1, False)),
            kernels=self.kernels, verify_modes=modes, sample_widths=(1,),
            sampling_batch_max=self.config.cuda_graph_sampling_batch_max))

    def _make_proposer(self, draft_model: LlamaForCausalLM | None) -> Proposer:
        config = self.config
        if config.speculative_method != "draft_model":
            return NgramProposer(NgramConfig(method=config.speculative_method, max_order=config.ngram_max_order,
                                             min_order=config.ngram_min_order, window=config.ngram_window))
        if draft_model is None:
            raise ValueError("speculative_method='draft_model' needs a draft model (draft_model=...)")
        pool = self.executor.make_pool(draft_model, config, prefix_caching=False)
        # draft step 1 feeds the tokens the draft has not seen: 1, 2 after a fully accepted
        # round, a few more after plain steps (longer catch-ups run as their own prefill);
        # small batches also get a graph for catch-up chunks
        feeds = range(1, DRAFT_MAX_FEED + 1)
        step = self.executor.make_forward(draft_model, pool, ForwardSpec(
            config.use_cuda_graphs, config.max_batch_size, shapes=tuple((w, False) for w in feeds),
            kernels=step_kernels(config, self.device, draft_model), sample_widths=tuple(feeds),
            small_batch_shapes=((CATCH_UP_CHUNK, False),), sampling_batch_max=config.cuda_graph_sampling_batch_max))
        # whole-round graphs now, not in the middle of a request: K after a round (1 or 2
        # tokens to feed) or a catch-up (max_feed), and the adaptive policy's one-token
        # probes; other lengths are captured on first use
        k = config.spec_length
        if self.draft_loop_rounds:
            step.prepare_draft_loops((1, 2, DRAFT_MAX_FEED), (k, 1) if config.spec_policy == "adaptive" else (k,))
        eager = self.executor.make_forward(draft_model, pool, ForwardSpec(max_batch_size=config.max_batch_size))
        self.draft = DraftModelProposer(draft_model, pool, step, eager)
        return self.draft

    def _make_policy(self) -> SpecPolicy:
        config = self.config
        if config.spec_policy == "fixed":
            return FixedPolicy(config.spec_length)
        c, slope = self._cost_coefficients()
        return AdaptivePolicy(AdaptiveConfig(k_max=config.spec_length, c=c, verify_slope=slope))

    def _cost_coefficients(self) -> tuple[float, float]:
        """(c, verify_slope) for the adaptive policy. On a GPU both are measured once here
        through the engine's own forward functions (batch 1, ~0.2-2 s); on a CPU c is the
        ratio of weight bytes and verification is taken as free. n-gram drafts cost c = 0;
        `spec_cost_coefficient` overrides c."""
        c = self.config.spec_cost_coefficient
        draft = self.draft
        if self.device.type != "cuda":
            if c is None:
                c = 0.0 if draft is None else weight_bytes(draft.model) / weight_bytes(self.model)
            return c, 0.0
        k = self.config.spec_length
        context = max(1, min(256, self.config.max_seq_len - k - 2))
        costs = measure_spec_costs(self.forward, self.cache_pool, None if draft is None else draft.step_forward,
                                   None if draft is None else draft.pool, self.model.config.vocab_size,
                                   StepCostConfig(context_len=context, max_seq_len=self.config.max_seq_len,
                                                  k_max=k, repeats=COST_REPEATS, warmup=COST_WARMUP))
        if c is None:
            c = costs.c if costs.c is not None else 0.0
        return c, max(0.0, (costs.verify_ratio[k] - 1.0) / k)

    # -- spec D1 names ---------------------------------------------------------------------------
    @property
    def target_cache_pool(self) -> CachePoolProtocol:
        return self.cache_pool

    @property
    def draft_cache_pool(self) -> CachePoolProtocol | None:
        return self.draft.pool if self.draft is not None else None

    # -- capacity: the proposer's memory beside the target's ---------------------------------------
    def pools(self) -> list[CachePoolProtocol]:
        return super().pools() + self.proposer.pools()

    def can_admit(self, request: Request) -> bool:
        return super().can_admit(request) and self.proposer.can_admit(request)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        # one position is a plain step's: the draft writes nothing then (it catches up, its
        # cache grown, when the request drafts again)
        return super().ensure_capacity(request, total_tokens) and (
            total_tokens <= request.num_computed_tokens + 1
            or self.proposer.ensure_capacity(request, total_tokens - 1))

    def decode_demand(self, request: Request) -> int:
        # K + 1 positions, never past max_seq_len (the length guard shrinks K there)
        room = self.config.max_seq_len - request.num_computed_tokens
        return self.spec_length + 1 if room > self.spec_length else max(1, room)

    def release(self, request: Request) -> None:
        self.proposer.release(request)
        self.policy.release(request.request_id)  # (a preempted request learns again)
        super().release(request)

    def leak_report(self) -> list[str]:
        return super().leak_report() + self.proposer.leak_report() + self.policy.leak_report()

    def _prefill_in_flight(self, requests: Sequence[Request]) -> None:
        """The proposer's per-request state (n-gram: the prompt's table) is built while the
        prefill's forward runs."""
        self.proposer.prefilled(requests)

    # -- the speculative decode step --------------------------------------------------------------
    def step(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> StepResult:
        if self.clock is None:
            return super().step(prefill, decode)
        start = self._time()
        self._step_kind = None
        rendered = super().step(prefill, decode)
        self.clock.stepped(start, None if prefill else self._step_kind)
        return rendered

    def draft_lengths(self, requests: Sequence[Request]) -> list[int]:
        """k per request this step: the policy's, cut by the length guards; all 0 above
        `spec_disable_batch_size`, and while the clock wants plain steps timed at this batch size."""
        limit = self.config.spec_disable_batch_size
        if limit is not None and len(requests) > limit:
            return [0] * len(requests)
        clock = self.clock
        ks = self.policy.choose(requests, 0.0 if clock is None else clock.overhead(len(requests)))
        max_len = self.config.max_seq_len
        ks = [guard_k(k, r.num_computed_tokens, max_len, r.tokens_left) for r, k in zip(requests, ks, strict=True)]
        if clock is not None and any(ks) and clock.needs_plain(len(requests)):
            return [0] * len(requests)
        return ks

    def _take_lengths(self, requests: Sequence[Request]) -> list[int]:
        """This step's draft lengths: decided by `_overlaps` already, or now."""
        ks, self._planned = self._planned, None
        return ks if ks is not None else self.draft_lengths(requests)

    def _overlaps(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> bool:
        """A plain step (nobody drafts) may be queued before the step in flight's tokens are
        read; a round may not: its proposals read them. (Overlapped, the speculative runner
        renders a round's tokens under the next round's verification: `_defers_render`.)"""
        self._planned = self.draft_lengths(decode) if decode else None
        return not any(self._planned or ()) and super()._overlaps(prefill, decode)

    def _defers_render(self) -> bool:
        return self.overlap

    def _decode(self, requests: Sequence[Request]) -> tuple[list[Request], torch.Tensor, list] | None:
        ks = self._take_lengths(requests)
        if not any(ks):  # nobody speculates this step: exactly the plain decode step
            self._step_kind = StepKind(len(requests), 0)
            return super()._decode(requests)
        drafts = self.proposer.propose(requests, ks)
        if not any(d.token_ids for d in drafts):  # no proposals at all (n-gram found no match)
            for r, k in zip(requests, ks, strict=True):
                if k:
                    self.policy.update(r.request_id, 0, 0)
            return super()._decode(requests)  # (a synchronous plain step: not timed)
        self._step_kind = StepKind(len(requests), max(len(d.token_ids) for d in drafts))
        self._accept(requests, drafts, self._verify(requests, drafts))
        return None  # (the round's tokens are accepted: none left in flight)

    def _verify(self, requests: Sequence[Request], drafts: Sequence[Draft]) -> VerifyResult:
        """Target forward over [g, t_1..t_k] per request, then accept/reject (D4, D5)."""
        num_draft = [len(d.token_ids) for d in drafts]
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [k + 1 for k in num_draft])
        k_pad = layout.width - 1
        ids = torch.zeros((len(requests), layout.width), dtype=torch.long)  # [B, K+1] CPU
        draft_tokens = torch.zeros((len(requests), k_pad), dtype=torch.long)  # [B, K] CPU
        for b, (r, d) in enumerate(zip(requests, drafts, strict=True)):
            ids[b, :len(d.token_ids) + 1] = torch.tensor([r.last_token_id, *d.token_ids])
            draft_tokens[b, :len(d.token_ids)] = torch.tensor(d.token_ids, dtype=torch.long)
        params = [r.sampling_params for r in requests]
        vocab = self.model.config.vocab_size
        if all(temperature_only(p, vocab) and p.logprobs is None for p in params):
            greedy = [p.greedy for p in params]
            uniforms = (torch.zeros((len(requests), k_pad + 1), dtype=torch.float64) if all(greedy)
                        else round_uniforms([r.generator for r in requests], num_draft, k_pad))  # [B, K+1]
            packed = self.forward.verify(ids, layout, draft_tokens, num_draft,
                                         self._draft_probs(drafts, draft_tokens),
                                         [1.0 if p.greedy else p.temperature for p in params], greedy, uniforms)
            self._render_backlog()  # (the previous round's tokens, while the GPU verifies)
            return unpack_rows(packed.tolist())  # the one host sync of verification
        logits = self.forward(ids, layout, all_logits=True)  # [B, K+1, V]
        self._render_backlog()
        result = self._accept_reject(requests, drafts, draft_tokens, logits)
        return replace(result, logprobs=emitted_logprobs(logits, result.tokens, [p.logprobs for p in params]))

    def _draft_probs(self, drafts: Sequence[Draft], draft_tokens: torch.Tensor) -> torch.Tensor | None:
        """[B, K, V] on the device (`stack_draft_probs`), None when every draft is one-hot."""
        return stack_draft_probs([d.probs for d in drafts], draft_tokens, [len(d.token_ids) for d in drafts],
                                 self.model.config.vocab_size, self.device)

    def _accept_reject(self, requests: Sequence[Request], drafts: Sequence[Draft], draft_tokens: torch.Tensor,
                       target_logits: torch.Tensor) -> VerifyResult:
        """The general pipeline: each row's sampling transforms per position, then `verify`.
        draft_tokens: [B, K] on the host; target_logits: [B, K+1, V]."""
        num_draft = [len(d.token_ids) for d in drafts]
        b, width, vocab = target_logits.shape
        k_pad = width - 1
        params = [r.sampling_params for r in requests]
        contexts = None  # the growing context per verified position: only the penalties read it
        if any(p.penalized for p in params):
            contexts = [r.all_token_ids + d.token_ids[:j] for r, d in zip(requests, drafts, strict=True)
                        for j in range(width)]
        flat_params = [p for p in params for _ in range(width)]
        target_probs = logits_to_probs(target_logits.reshape(b * width, vocab), flat_params,
                                       contexts).view(b, width, vocab)  # [B, K+1, V]
        draft_probs = self._draft_probs(drafts, draft_tokens)
        uniforms = to_device(round_uniforms([r.generator for r in requests], num_draft, k_pad), self.device)  # [B, K+1]
        return verify(draft_tokens, num_draft, draft_probs, target_probs, uniforms[:, :k_pad], uniforms[:, k_pad])

    def _accept(self, requests: Sequence[Request], drafts: Sequence[Draft], result: VerifyResult) -> None:
        """Roll both caches back (D6), record metrics (D9), accept the tokens in order (up to
        a finish their ids decide: EOS, a stop id, the length)."""
        logprobs = result.logprobs or [[] for _ in requests]
        for r, d, tokens, a, row_lps in zip(requests, drafts, result.tokens, result.num_accepted, logprobs,
                                            strict=True):
            if r.is_finished:  # cut by a stop string rendered under this round: a wasted row
                continue
            k = len(d.token_ids)
            n = r.num_computed_tokens
            self.cache_pool.truncate_to(r.slot, n + a + 1)
            r.num_computed_tokens = n + a + 1
            self.proposer.on_accepted(r, a)
            self.stats.record(k, a, self._emit_round(r, k, a, tokens, row_lps))

    def _emit_round(self, r: Request, depth: int, a: int, tokens: Sequence[int], row_lps: Sequence | None) -> int:
        """Record one round of `depth` proposed tokens, `a` accepted, for the policy and the
        request's metrics; accept its tokens in order (up to a finish their ids decide).
        Returns the tokens emitted."""
        self.policy.update(r.request_id, depth, a)
        if depth > 0:
            r.speculation_acceptance_rates.append(a / depth)
        emitted = 0
        for j, t in enumerate(tokens):
            self.output.accept(r, t, row_lps[j] if row_lps else None)
            emitted += 1
            if r.stop_pending is not None:
                break
        r.spec_rounds += 1
        r.spec_tokens_emitted += emitted
        return emitted
