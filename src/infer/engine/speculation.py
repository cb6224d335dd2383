"""Speculation: what the runner needs to draft, built once from the engine's resolved config.

`Speculation.build` makes the proposer, the length policy, the round clock and the round's
draft shape (a chain, the static `spec_tree`, or dynamic trees); `depths` gives each decode
request's draft depth per step. docs/speculation.md, "Depths per request".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.engine.executor.factory import Executor
from infer.engine.executor.head_graphs import make_head_round
from infer.engine.executor.spec import ForwardSpec
from infer.engine.kv_manager import plain_step
from infer.engine.parts import EAGLE_METHODS, MEDUSA, ResolvedConfig, SpeculativeConfig
from infer.engine.request import Request
from infer.engine.step_costs import (DraftStepFn, MedusaStepFn, RoundStepFn, StepCostConfig, measure_spec_costs,
                                     weight_bytes)
from infer.models.capture import HiddenCapture
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import Kernels
from infer.models.llama import LlamaForCausalLM
from infer.models.medusa import MedusaHead
from infer.speculative.draft_model import DRAFT_MAX_FEED, DraftModelProposer
from infer.speculative.eagle import EagleProposer
from infer.speculative.foreign_draft import ForeignDraftProposer
from infer.speculative.forward import ForwardFn
from infer.speculative.medusa import MedusaProposer
from infer.speculative.metrics import SpecStats
from infer.speculative.ngram import NgramProposer
from infer.speculative.node_tree import DynamicShape
from infer.speculative.policy import (AdaptiveConfig, AdaptivePolicy, FixedPolicy, RoundClock, ShadowRounds,
                                      SpecPolicy)
from infer.speculative.proposer import Proposer
from infer.speculative.suffix import SuffixProposer
from infer.speculative.tree import Draft, TreeShape, chain_shape
from infer.speculative.vocab_map import VocabMap
from infer.transfer import tensor_on

# the adaptive policy's one-off cost measurement at start (GPU): timed calls per shape
COST_REPEATS, COST_WARMUP = 10, 3


def guard_k(k: int, seq_len: int, max_seq_len: int, tokens_left: int) -> int:
    """Overflow guard: positions seq_len..seq_len+k must fit; no more drafts than can be emitted."""
    return max(0, min(k, max_seq_len - seq_len - 1, tokens_left - 1))


def check_request_speculation(speculation: bool | int | None, spec_length: int | None) -> None:
    """ValueError when a request's `SamplingParams.speculation` asks for more than the engine
    drafts: a K above `spec_length`, or any K when the engine has no speculation (None)."""
    if speculation is None or speculation is False:
        return
    if spec_length is None:
        raise ValueError(f"speculation {speculation} asks for speculative decoding, which this engine does not run: "
                         "leave speculation unset or False, or start the engine with speculative decoding")
    if speculation > spec_length:
        raise ValueError(f"speculation {speculation} is more than this engine drafts (spec_length {spec_length}): "
                         f"ask for at most {spec_length}, or None for the engine's policy, False for none")


def fit_depth(shape: TreeShape | DynamicShape, k: int, seq_len: int, max_seq_len: int) -> int:
    """The largest depth <= k whose block fits: positions seq_len .. seq_len + shape.span(depth)."""
    while k > 0 and seq_len + shape.span(k) >= max_seq_len:
        k -= 1
    return k


@dataclass
class Speculation:
    proposer: Proposer
    draft: DraftModelProposer | None  # the draft model's proposer (in its own ids: another vocabulary's is wrapped)
    policy: SpecPolicy
    clock: RoundClock | None  # steps timed: the adaptive policy's round overhead, the batch gate
    config: SpeculativeConfig
    max_seq_len: int  # no position of a round past it
    stats: SpecStats
    shadow: ShadowRounds | None = None  # free drafts under the adaptive policy (speculative/policy.py)
    restorer: EagleProposer | None = None  # the head whose prompt blocks a prefix hit restores (`restorable`)

    @classmethod
    def build(cls, config: ResolvedConfig, executor: Executor, draft_model: LlamaForCausalLM | None,
              draft_kernels: Kernels, head: EagleHead | None = None,
              target: LlamaForCausalLM | None = None, vocab_map: VocabMap | None = None,
              medusa: MedusaHead | None = None) -> Speculation:
        """The proposer and policy (the adaptive policy's costs are measured by `start`).
        EAGLE / Medusa heads need `target` (its `capture`); `vocab_map`: a draft model with
        another vocabulary. Raises ValueError when the method's model is missing."""
        spec = config.speculative
        assert spec is not None, "an engine without speculation builds no Speculation"
        draft = None
        proposer: Proposer
        if spec.method in EAGLE_METHODS:
            if head is None or target is None or target.capture is None:
                raise ValueError(f"speculative_method={spec.method!r} needs an EAGLE head loaded "
                                 "with its target (engine.loading.load_models)")
            proposer = _eagle_proposer(config, executor, head, target.capture, draft_kernels)
        elif spec.method == MEDUSA:
            if medusa is None or target is None or target.capture is None:
                raise ValueError("speculative_method='medusa' needs Medusa heads loaded with their target "
                                 "(engine.loading.load_models)")
            proposer = MedusaProposer(medusa, target.capture, draft_kernels)
        elif spec.suffix is not None:
            proposer = SuffixProposer(spec.suffix)
        elif spec.ngram is not None:
            proposer = NgramProposer(spec.ngram)
        elif draft_model is None:
            raise ValueError("speculative_method='draft_model' needs a draft model (draft_model=...)")
        else:
            proposer, draft = _draft_proposer(config, executor, draft_model, draft_kernels, vocab_map)
        policy: SpecPolicy = FixedPolicy(spec.length)
        stats = SpecStats(shared_vocabulary=None if vocab_map is None else vocab_map.fraction)
        return cls(proposer, draft, policy, None, spec, config.scheduler.max_seq_len, stats)

    @property
    def tree(self) -> TreeShape | DynamicShape | None:
        """The round's tree; None: chains of up to `spec_length`."""
        return self.config.tree

    @property
    def spec_length(self) -> int:
        return self.config.length

    def start(self, forward: ForwardFn, pool: CachePoolProtocol, target: LlamaForCausalLM) -> None:
        """Once the target's forward exists: check a tree against the vocabulary, measure the adaptive costs."""
        if self.tree is not None and max(self.tree.widths) > target.config.vocab_size:
            raise ValueError(f"spec_tree {self.tree} asks for {max(self.tree.widths)} children of a node but "
                             f"the vocabulary has {target.config.vocab_size} tokens")
        overhead = None
        if self.config.policy == "adaptive":
            c, slope = self._cost_coefficients(forward, pool, target)
            policy = self.policy = AdaptivePolicy(AdaptiveConfig(k_max=self.spec_length, c=c, verify_slope=slope))
            if self.config.cost_coefficient is None:  # (a given c is taken as is: no overhead timed)
                overhead = policy.round_cost
            if isinstance(self.proposer, NgramProposer) and self.tree is None:
                self.shadow = ShadowRounds(self.proposer, self.spec_length)
        if overhead is not None or self.config.batch_gate:
            self.clock = RoundClock(overhead, gate=self.config.batch_gate)

    def _cost_coefficients(self, forward: ForwardFn, pool: CachePoolProtocol,
                           target: LlamaForCausalLM) -> tuple[float, float]:
        """(c, verify_slope) for the adaptive policy: measured on a GPU (docs/speculation.md,
        "Step costs"); on a CPU c is the weight-byte ratio and verification free (c = 0 for
        n-gram drafts). `spec_cost_coefficient` overrides c."""
        c = self.config.cost_coefficient
        draft, head = self.draft, self.proposer if isinstance(self.proposer, EagleProposer) else None
        medusa = self.proposer if isinstance(self.proposer, MedusaProposer) else None
        if next(target.parameters()).device.type != "cuda":
            if c is None and medusa is not None:
                c = weight_bytes(medusa.head) / medusa.head.spec.num_heads / weight_bytes(target)
            if c is None:
                model = draft.model if draft is not None else head.head if head is not None else None
                c = 0.0 if model is None else weight_bytes(model) / weight_bytes(target)
            return c, 0.0
        k = self.spec_length
        context = max(1, min(256, self.max_seq_len - k - 2))
        step: DraftStepFn | None = None
        step_pool = None
        if draft is not None:
            step, step_pool = draft.step_forward, draft.pool
        elif head is not None:
            step, step_pool = RoundStepFn(head.round_fn, head.head), head.pool
        elif medusa is not None:  # (no cache of its own: timed on a scratch slot of the target's pool)
            step, step_pool = MedusaStepFn(medusa.head, target.model.norm.weight.dtype, medusa.kernels), pool
        vocab = target.config.vocab_size  # (timed with ids both models hold: a draft may have another vocabulary)
        vocab = min(vocab, draft.model.config.vocab_size) if draft is not None else vocab
        costs = measure_spec_costs(forward, pool, step, step_pool, vocab,
                                   StepCostConfig(context_len=context, max_seq_len=self.max_seq_len,
                                                  k_max=k, repeats=COST_REPEATS, warmup=COST_WARMUP))
        if c is None:
            c = costs.c if costs.c is not None else 0.0
        return c, max(0.0, (costs.verify_ratio[k] - 1.0) / k)

    def shape(self, depths: Sequence[int]) -> TreeShape | DynamicShape:
        """The round's draft shape: the tree, or a chain as long as the deepest row's."""
        return self.tree if self.tree is not None else chain_shape(max(depths))

    def width(self, k: int) -> int:
        """Positions a round of depth k writes to either cache at most: g and the nodes."""
        return 1 + (self.tree.span(k) if self.tree is not None and k > 0 else k)

    def max_depth(self, request: Request) -> int:
        """The deepest round the request may draft now, before the policy: its own
        `speculation`, the length guards and a tree's storage."""
        max_len = self.max_seq_len
        own = request.sampling_params.max_drafts
        k = self.spec_length if own is None else min(own, self.spec_length)
        k = guard_k(k, request.num_computed_tokens, max_len, request.tokens_left)
        return fit_depth(self.tree, k, request.num_computed_tokens, max_len) if self.tree is not None else k

    def decode_widths(self, batch: int) -> Callable[[Request], list[int]]:
        """When `batch` requests decode: a request -> the blocks its next step may write, largest
        first, down to a plain step; only the plain step where the batch runs plain whatever it drafts."""
        return plain_step if self.plain_batch(batch) else self._widths

    def _widths(self, request: Request) -> list[int]:
        deepest = self.max_depth(request)
        if self.tree is None:  # (a chain of k writes 1 + k)
            return list(range(deepest + 1, 0, -1))
        return sorted({self.width(k) for k in range(deepest + 1)}, reverse=True)

    def plain_batch(self, batch: int) -> bool:
        """Whether a step of `batch` decoding requests runs plain whatever they would draft: past
        `disable_batch_size`, a plain step the clock needs, or the batch gate holding off."""
        limit, clock = self.config.disable_batch_size, self.clock
        return (limit is not None and batch > limit) or clock is not None and (
            clock.needs_plain(batch) or clock.gate and clock.holds_off(batch))

    def depths(self, requests: Sequence[Request], room: Sequence[int] | None = None) -> list[int]:
        """Each request's draft depth this step; `room`: the positions reserved for each (None: the largest round's)."""
        limit = self.config.disable_batch_size
        if limit is not None and len(requests) > limit:
            return [0] * len(requests)
        clock, shadow = self.clock, self.shadow
        willing = [r for r in requests if self.drafts_for(r)]
        if shadow is not None:
            for request_id, drafted, accepted in shadow.settle(willing):
                self.policy.observe(request_id, drafted, accepted)
        n = len(requests)
        chosen = self.policy.choose(willing, 0.0 if clock is None else clock.overhead(n))  # (moves an adaptive policy)
        if clock is not None and not clock.needs_plain(n) and clock.gate and clock.holds_off(n):
            # the gate's answer is known (no): it is asked only to count its wait, where a row would draft
            if any(k and self.max_depth(r) for k, r in zip(chosen, willing, strict=True)):
                clock.pays(n)
            ks = [0] * n
        else:
            drafting = iter(chosen)
            ks = [min(next(drafting), self.max_depth(r)) if self.drafts_for(r) else 0 for r in requests]
            if room is not None:
                ks = [self._fit_room(k, w) for k, w in zip(ks, room, strict=True)]
            if clock is not None and any(ks) and (clock.needs_plain(n) or clock.gate and not clock.pays(n)):
                ks = [0] * n
        if shadow is not None:
            for r, k in zip(requests, ks, strict=True):
                if k:
                    shadow.drop(r.request_id)
            shadow.draft([r for r, k in zip(requests, ks, strict=True) if not k and self.drafts_for(r)])
        return ks

    @staticmethod
    def drafts_for(request: Request) -> bool:
        """Whether the request may draft at all (not `speculation=False`)."""
        return request.sampling_params.max_drafts != 0

    def _fit_room(self, k: int, room: int) -> int:
        while k > 0 and self.width(k) > room:
            k -= 1
        return k

    # -- the proposer's hooks, for the requests that may draft -------------------------------
    def observed(self, requests: Sequence[Request], starts: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
        """`Proposer.observed` of the requests that may draft."""
        keep = [i for i, r in enumerate(requests) if self.drafts_for(r)]
        if keep:
            self.proposer.observed([requests[i] for i in keep], [starts[i] for i in keep], [rows[i] for i in keep])

    def prefilled(self, requests: Sequence[Request]) -> None:
        """`Proposer.prefilled` of the requests that may draft."""
        keep = [r for r in requests if self.drafts_for(r)]
        if keep:
            self.proposer.prefilled(keep)

    def on_accepted(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        """`Proposer.on_accepted` of the requests that may draft."""
        keep = [i for i, r in enumerate(requests) if self.drafts_for(r)]
        if keep:
            self.proposer.on_accepted([requests[i] for i in keep], [paths[i] for i in keep])

    def verifying(self, requests: Sequence[Request], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """`Proposer.verifying` of the requests that may draft (verdict [B, K + 2] their rows)."""
        keep = [i for i, r in enumerate(requests) if self.drafts_for(r)]
        if len(keep) < len(requests):
            verdict = verdict[tensor_on(keep, verdict.device, torch.long)]
        if keep:
            self.proposer.verifying([requests[i] for i in keep], [drafts[i] for i in keep],
                                    [starts[i] for i in keep], verdict)

    def can_follow(self, requests: Sequence[Request], k: int) -> bool:
        """`Proposer.can_follow` (every request drafting)."""
        return all(self.drafts_for(r) for r in requests) and self.proposer.can_follow(requests, k)

    # -- its memory: a `KVHolder` of the scheduler's KV manager ------------------------------
    def can_admit(self, request: Request) -> bool:
        return not self.drafts_for(request) or self.proposer.can_admit(request)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        """Room for a round; under a fixed K the proposer's memory is taken now."""
        take = isinstance(self.policy, FixedPolicy) and self.config.disable_batch_size is None
        return self.proposer.ensure_capacity(request, total_tokens, take)

    def pools(self) -> list[CachePoolProtocol]:
        return self.proposer.pools()

    def release(self, request: Request) -> None:
        """Free the request's memory; what the policy learnt of it stays (preemption)."""
        self.proposer.release(request)

    def forget(self, request: Request) -> None:
        """The request left the engine: drop what the policy learnt of it."""
        self.policy.release(request.request_id)
        if self.shadow is not None:
            self.shadow.drop(request.request_id)

    # -- an EAGLE head's prompt blocks at a prefix hit: a `PrefixRestorer` of the KV manager ------
    def restorable(self, request: Request) -> int:
        """The head's `restorable`; a request that never drafts: its whole prompt."""
        if not self.drafts_for(request):
            return len(request.prompt_token_ids)
        assert self.restorer is not None
        return self.restorer.restorable(request)

    def restore(self, request: Request, tokens: int) -> None:
        """The head's `restore`, for a request that may draft."""
        if self.drafts_for(request):
            assert self.restorer is not None
            self.restorer.restore(request, tokens)

    def leak_report(self) -> list[str]:
        shadow = self.shadow.leak_report() if self.shadow is not None else []
        return self.proposer.leak_report() + self.policy.leak_report() + shadow


def _draft_proposer(config: ResolvedConfig, executor: Executor, draft_model: LlamaForCausalLM, kernels: Kernels,
                    vocab_map: VocabMap | None) -> tuple[Proposer, DraftModelProposer]:
    """The draft model's proposer and the `DraftModelProposer` drafting in its ids (the same, or wrapped)."""
    assert config.speculative is not None
    tree, batch = config.speculative.tree, config.scheduler.max_batch_size
    pool = executor.make_pool(draft_model, config.cache, prefix_caching=False)
    # step 1 feeds the tokens the draft has not seen (longer catch-ups run as chunks), a tree's levels its frontier
    width = max(DRAFT_MAX_FEED, 1 + (tree.span(tree.depth) if tree is not None else 0))
    spec = ForwardSpec(config.execution.use_cuda_graphs, batch, kernels, tokens=batch * width, trees=tree is not None)
    forward = executor.make_forward(draft_model, pool, spec)
    if vocab_map is None:
        draft = DraftModelProposer(draft_model, pool, forward)
        return draft, draft
    foreign = ForeignDraftProposer.build(draft_model, pool, forward, vocab_map)
    return foreign, foreign.inner


def _eagle_proposer(config: ResolvedConfig, executor: Executor, head: EagleHead, capture: HiddenCapture,
                    kernels: Kernels) -> EagleProposer:
    """The head's proposer: its pool and round function, chain graphs captured now (feeds up to
    K + 1 wide); a tree's rounds run eagerly."""
    spec, execution = config.speculative, config.execution
    assert spec is not None
    pool = executor.make_pool(head, config.cache, prefix_caching=False)
    round_fn = make_head_round(head, pool, execution.use_cuda_graphs, config.scheduler.max_batch_size,
                               execution.cuda_graph_sampling_batch_max, kernels)
    feed_max = spec.length + 1
    steps = (spec.length, 1) if spec.policy == "adaptive" else (spec.length,)
    if spec.tree is None:
        round_fn.prepare(range(1, feed_max + 1), steps, ahead=True)
    proposer = EagleProposer(head, pool, capture, round_fn, feed_max=feed_max, kernels=kernels)
    proposer.round_steps = steps
    return proposer
