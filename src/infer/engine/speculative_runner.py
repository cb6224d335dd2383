"""SpeculativeRunner: propose -> verify -> accept -> roll back (spec D1, D3-D6, D9).

Prefill is the ContinuousRunner's (target only; the draft prefills lazily). A decode step:

1. the policy picks k per request (fixed K or adaptive; overflow guard near max_seq_len);
2. the proposer drafts up to k tokens per request (draft model: K batched draft steps;
   n-gram: table lookups);
3. one batched target forward over [g, t_1..t_k] per request (g: the pending token),
   written to the target cache like a chunked prefill at positions n..n+k;
4. `rejection.verify` accepts a prefix of each draft and adds one recovered or bonus token;
5. both caches are truncated to n + a + 1 tokens; the tokens are emitted one by one through
   the OutputProcessor, so a stop inside an accepted run ends the request there.

Batches whose rows sample with a temperature alone (greedy included) verify through the
forward function's `verify` (`rejection.verify_logits`; a CUDA graph on the GPU); rows with
top-k, top-p or a repetition penalty take the general pipeline (`logits_to_probs`, `verify`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig
from infer.engine.forward import ForwardFn, make_forward
from infer.engine.plain_stretch import PlainStretch
from infer.engine.request import Request
from infer.engine.runner import ContinuousRunner, StepResult, make_pool_for, step_kernels
from infer.engine.stretch_finishes import StretchFinishes
from infer.models.llama import LlamaForCausalLM
from infer.sampling import draw_uniforms, logits_to_probs, temperature_only
from infer.spec.draft_model import CATCH_UP_CHUNK, DRAFT_MAX_FEED, DraftModelProposer
from infer.spec.costs import batch_samples, request_samples
from infer.spec.episodes import Episode
from infer.spec.metrics import SpecStats
from infer.spec.policy import AdaptivePolicy, CostModel, FixedPolicy, SpecPolicy
from infer.spec.proposer import Draft, Proposer
from infer.spec.rejection import VerifyResult, unpack_rows, verify
from infer.spec.shadow import ShadowDrafts
from infer.tokenizer import Tokenizer
from infer.transfer import to_device


# a plain stretch times one of its steps in this many for the plain baseline (the policy
# only needs its recent median, and timing every step costs host time on the thin path)
PLAIN_SAMPLE_EVERY = 16
# a plain step outside a stretch (one next to a round or a choice: its host code runs cold,
# H100 demo target: 17-25 % dearer than a stretch step) is timed only while the baseline is
# missing, or once this many plain steps went by without a sample (speculating steadily)
PLAIN_RESAMPLE_EVERY = 64
# a plain stretch brings the proposer's tables up to date (`keep_up`) every this many steps
# and at its last: each call costs more than its own few us even under the forward (H100,
# demo target: +8-11 us a step every step, none every 8th, `scripts/inflight_slack.py`),
# and the round after a stretch then catches up on at most this many tokens
KEEP_UP_EVERY = 8
# an episode (spec/episodes.py) that has run this many steps is ended as soon as it emitted
# fewer tokens than plain decoding would have in its time (`Episode.losing`): the policy's
# calibration hears of it then, not at the next plain decision or batch change. A round
# priced from a neighbouring batch size's (H100, draft model at W2-prefix T=0, batch 32,
# run 23a: priced as batch 16's, 2.7 plain steps, and taking 6.3) ran 12 steps of 6-10 ms
# before the batch changed, realizing half a plain step's tokens a plain step of time
EPISODE_CHECK_STEPS = 3


class SpeculativeRunner(ContinuousRunner):
    def __init__(self, target_model: LlamaForCausalLM, draft_model: LlamaForCausalLM | None,
                 tokenizer: Tokenizer | None, config: EngineConfig, eos_token_ids: tuple[int, ...]) -> None:
        super().__init__(target_model, tokenizer, config, eos_token_ids)
        self.spec_length = config.spec_length
        self.stats = SpecStats()
        self.draft: DraftModelProposer | None = None
        self.proposer: Proposer = self._make_proposer(draft_model)
        self.cost_model = CostModel(config.spec_length)
        self._plain_steps = 0
        self._plain_sampled_at = 0  # `_plain_steps` at the latest plain sample
        # a stretch ended while the scheduler reserved the next step (a preemption): some
        # requests may hold plain's one position, so that step is plain
        self._plain_reserved = False
        self._take_shadows = True  # whether `_in_flight` takes this plain step's shadow drafts
        # the speculative episode under way (spec/episodes.py), and the one-off setup seconds
        # (graph captures) of the step in progress, which it does not count
        self._episode: Episode | None = None
        self._one_off = 0.0
        # this engine step also runs prefill chunks: its decode's time is not the decode's
        # alone (a chunk whose prompt goes on queues GPU work the decode's sync waits for)
        self._mixed = False
        self._held = 0  # requests holding a slot (the decode batch to be, for a prefill)
        # seconds this step spent on shadow drafts and the proposer's table upkeep, which a
        # timed plain step leaves out of the plain baseline (`_observe_plain`)
        self._upkeep = 0.0
        self._stretch_upkeep = 0.0  # the same over the plain stretch under way (reported at its end)
        self._stretch_requests: Sequence[Request] = ()  # that stretch's batch (set as it starts)
        self._stretch_shadowing = True  # whether the plain stretch under way takes shadow drafts
        # that stretch's batch, for finishes whose bookkeeping waits for its end (None: a
        # shadowing stretch, or none under way)
        self._stretch_finishes: StretchFinishes | None = None
        # the latest decode step's measurements, extended once the next step starts by the
        # time in between (`_until_next_step`), and when that step ended
        self._pending: list[tuple[float, Callable[[float], None]]] = []
        self._step_end = 0.0
        # recorded after a forward is queued, asked by table builds under it (`_busy`)
        self._gpu_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self.shadow: ShadowDrafts | None = None
        self.policy = FixedPolicy(config.spec_length)
        if config.spec_policy == "adaptive":
            from infer.engine.calibration import measure_costs
            self.cost_model = measure_costs(
                self.forward, self.cache_pool, self.draft.step_forward if self.draft else None,
                self.draft.pool if self.draft else None, self.model.config.vocab_size, config.max_batch_size,
                config.spec_length)
            shadowed = self.proposer.shadow_drafts
            # (drafts free enough to take in shadow are free enough for every row of a round)
            self.policy = adaptive = AdaptivePolicy(config.spec_length, self.cost_model, shadowed=shadowed,
                                                    catch_up_units=getattr(self.proposer, "catch_up_units", None),
                                                    riders=shadowed)
            if shadowed:
                self.shadow = ShadowDrafts(config.spec_length, adaptive.observe_shadow,
                                           found=adaptive.proposal_ready)
            if hasattr(self.proposer, "admit"):  # n-gram: a table only where it can pay for itself
                self.proposer.admit = self._table_pays  # type: ignore[attr-defined]
        # steps under a standing all-plain decision, run through the plain runner's methods
        # (shadow drafts, if any, go on under their forwards); one in PLAIN_SAMPLE_EVERY of
        # them is timed for the plain baseline
        self._stretch = PlainStretch(self, ContinuousRunner, self._stretch_done,
                                     self._stretch_shadows if self.shadow is not None else None,
                                     self._stretch_found if self.shadow is not None else None,
                                     on_timed=self._observe_plain, time_every=PLAIN_SAMPLE_EVERY)

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self._proposer = proposer
        # a proposer's optional `keep_up(requests)` (n-gram): builds or updates its per-request
        # state while prefill and plain stretch forwards run
        self._keep_up: Callable[..., None] | None = getattr(proposer, "keep_up", None)
        # and its `ready(request)`: whether a lookup could draft for it now without a build
        # (in a batch, one that could not drafts nothing: `_speculative_decode` skips such steps)
        self._servable: Callable[[Request], bool] | None = getattr(proposer, "ready", None)
        # and its `building`: whether `keep_up` left tables part-built (`_build_tables`)
        self._tables_building: Callable[[], bool] | None = (
            (lambda: proposer.building) if hasattr(proposer, "building") else None)  # type: ignore[attr-defined]

    @property
    def policy(self) -> SpecPolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: SpecPolicy) -> None:
        self._policy = policy
        # a policy's optional `quiet(requests)`: a standing all-plain decision (the thin path)
        self._policy_quiet: Callable[[Sequence[Request]], bool] | None = getattr(policy, "quiet", None)
        # and `holds_quiet(request)`: whether that decision covers a request at the next step
        # (the scheduler then reserves one position for it, as for plain decoding)
        self._holds_quiet: Callable[[Request], bool] | None = getattr(policy, "holds_quiet", None)
        # and `keep_quiet_without(request)`: whether it holds for the batch without a request
        self._keep_quiet_without: Callable[[Request], bool] | None = getattr(policy, "keep_quiet_without", None)
        # and `end_quiet()`: drop it (the batch changed)
        self._end_quiet: Callable[[], None] | None = getattr(policy, "end_quiet", None)
        # and `quiet_steps_left()`: how many more steps it holds for the same batch
        self._quiet_left: Callable[[], int] | None = getattr(policy, "quiet_steps_left", None)
        # and `episode_gain()` / `observe_episode(...)`: speculative episodes (spec/episodes.py)
        self._episode_gain: Callable[[], float | None] | None = getattr(policy, "episode_gain", None)
        # and `worth_shadowing(batch_size, sampled)`: whether shadow drafts (and the tables
        # they read) can change anything at that batch size; `count_shadowed(batch_size,
        # sampled, steps)`: plain steps that took them
        self._worth_shadowing: Callable[[int, bool], bool] | None = getattr(policy, "worth_shadowing", None)
        self._count_shadowed: Callable[[int, bool, int], None] | None = getattr(policy, "count_shadowed", None)
        # and `table_pays(batch_size, sampled, tokens_left, index_tokens, seconds_per_token)`:
        # whether a request's proposer state (an n-gram table) can pay for itself (`_table_pays`)
        self._policy_table_pays: Callable[..., bool] | None = getattr(policy, "table_pays", None)
        # and `charge(batch_size, sampled, lost, plain=None)`: what a step cost beyond plain
        # decoding's worth of its tokens, for the loss ledger (spec/loss_ledger.py, `_charge`)
        self._policy_charge: Callable[..., None] | None = getattr(policy, "charge", None)

    def _make_decode_forward(self) -> ForwardFn:
        # verification: widths 1..K+1 (k varies per round with the policy and the overflow guard);
        # plain decode (every k = 0) reuses the ContinuousRunner path: width 1, last logits,
        # temperature sampling captured too.
        # The acceptance step is captured too: greedy batches, one-hot drafts (n-gram, greedy
        # draft rows) and, for a draft model, its probabilities
        verify = [(w, True) for w in range(1, self.config.spec_length + 2)]
        modes = ("greedy", "one_hot") + (("draft_probs",) if self.config.speculative_method == "draft_model" else ())
        return make_forward(self.model, self.cache_pool, self.config.use_cuda_graphs, self.config.max_batch_size,
                            shapes=verify + [(1, False)], kernels=self.kernels, verify_modes=modes,
                            sample_widths=(1,), sampling_batch_max=self.config.cuda_graph_sampling_batch_max)

    def _make_proposer(self, draft_model: LlamaForCausalLM | None) -> Proposer:
        method = self.config.speculative_method
        if method == "draft_model":
            if draft_model is None:
                raise ValueError("speculative_method='draft_model' needs a draft model (draft_model=...)")
            pool = make_pool_for(draft_model.config, self.config, self.dtype, self.device, prefix_caching=False)
            # draft step 1 feeds the tokens the draft has not seen: 1, 2 after a fully accepted
            # round, a few more after plain steps (longer catch-ups run as their own prefill)
            feeds = range(1, DRAFT_MAX_FEED + 1)
            # small batches also get a graph for catch-up chunks (switching back to drafting)
            step = make_forward(draft_model, pool, self.config.use_cuda_graphs, self.config.max_batch_size,
                                shapes=[(w, False) for w in feeds],
                                kernels=step_kernels(self.config, self.device, draft_model),
                                sample_widths=tuple(feeds), small_batch_shapes=[(CATCH_UP_CHUNK, False)],
                                sampling_batch_max=self.config.cuda_graph_sampling_batch_max)
            capture = getattr(step, "capture_draft_loops", None)
            if capture is not None:  # whole-round graphs now, not in the middle of a request
                k = self.config.spec_length
                if self.config.spec_policy == "adaptive":  # any K, after any gap
                    capture(feeds, range(1, k + 1))
                else:  # K after a round (1 or 2 tokens to feed) or a catch-up (max_feed); a K
                    # the overflow guard shortens is captured when first used
                    capture((1, 2, DRAFT_MAX_FEED), (k,))
            self.draft = DraftModelProposer(draft_model, pool, step)
            return self.draft
        from infer.spec.ngram import NgramConfig, NgramProposer
        return NgramProposer(NgramConfig(method=method, max_order=self.config.ngram_max_order,
                                         min_order=self.config.ngram_min_order, window=self.config.ngram_window))

    # -- spec D1 names ---------------------------------------------------------------------------
    @property
    def target_cache_pool(self):  # noqa: ANN201
        return self.cache_pool

    @property
    def draft_cache_pool(self):  # noqa: ANN201
        return self.draft.pool if self.draft is not None else None

    @property
    def _draft_slots(self) -> dict[int, int]:
        return self.draft._draft_slots if self.draft is not None else {}

    @property
    def _draft_prefilled(self) -> set[str]:
        return self.draft._draft_prefilled if self.draft is not None else set()

    # -- capacity: both pools in lockstep -------------------------------------------------------
    def can_admit(self, request: Request) -> bool:
        ok = super().can_admit(request)
        return ok and (self.draft is None or self.draft.can_allocate(request.prefill_target))

    def allocate(self, request: Request) -> None:
        # the batch changes (admission comes before the scheduler reserves the next step:
        # every request then reserves through the runner's own `decode_demand`)
        self._end_stretch(reserving=False)
        self._end_episode()
        super().allocate(request)
        self._held += 1  # (its draft slot comes with its first round: `DraftModelProposer.propose`)
        if self.shadow is not None:
            self.shadow.admit(request.request_id)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        # (called for every decoding request before every step: kept to the pool calls)
        assert request.slot is not None
        if not self.cache_pool.ensure_capacity(request.slot, total_tokens):
            return False
        # one position is a plain step's (`decode_demand`): the draft writes nothing then
        # (it catches up, its cache grown, when the request speculates again)
        return (self.draft is None or total_tokens <= request.num_computed_tokens + 1
                or self.draft.ensure_capacity(request, total_tokens - 1))

    def decode_demand(self, request: Request) -> int:
        # a request the policy keeps plain at the next step: one position, as plain decoding
        # (`_decode` then never drafts for it); else K + 1 positions, never past max_seq_len
        # (the policy's overflow guard shrinks K there)
        holds = self._holds_quiet
        if holds is not None and holds(request):
            return 1
        room = self.config.max_seq_len - request.num_computed_tokens
        return self.spec_length + 1 if room > self.spec_length else max(1, room)

    def release(self, request: Request) -> None:
        finishes = self._stretch_finishes
        if finishes is not None:
            if request.is_finished and request.slot is not None and finishes.take(request):
                # the all-plain decision stands for the rest as it is: the slots go now, the
                # speculative bookkeeping when the stretch ends (`_finish_deferred`)
                self._held -= 1
                if self.draft is not None:  # (a draft slot, if it drafted: its target slot is free now)
                    self.draft.release(request)
                ContinuousRunner.release(self, request)
                return
            self._finish_deferred(end=False)  # (before the policy is asked about the rest)
        if request.slot is not None:  # (an abort releases a request twice: the second changes nothing)
            keep = self._keep_quiet_without
            if keep is not None and keep(request):
                # the standing all-plain decision holds for the rest (`keep_quiet_without`): a
                # stretch under way goes on with them (its shadows only if still worth it
                # there; only a shadowing stretch reports on its batch, `_stretch_done`)
                if finishes is not None:
                    finishes.drop(request)
                if self._stretch_shadowing:
                    rest = self._stretch_requests = [r for r in self._stretch_requests if r is not request]
                    self._stretch_shadowing = bool(rest) and self._shadowing(len(rest), batch_samples(rest))
            else:
                # the batch changes: a request leaving unfinished may be a preemption while
                # the scheduler reserves the next step (a finish comes after a step)
                self._end_stretch(reserving=not request.is_finished)
                if request.is_finished and self._end_quiet is not None:
                    # nobody has reserved the next step yet: the decision ends now, and that
                    # step asks `choose` (else it would reserve plain's one position under the
                    # decision, decode plainly and end it, and only the step after ask: H100,
                    # W2 T=0, n-gram, ~3.5 such steps a cycle at batch 1-8, run 24a)
                    self._end_quiet()
            self._end_episode()
            self._held -= 1
        self.proposer.release(request)
        if self.shadow is not None:
            self.shadow.release(request.request_id)
        if request.is_finished:
            self.policy.release(request.request_id)
        super().release(request)

    def free_kv_tokens(self) -> int | None:
        caps = [c for c in (self.cache_pool.free_token_capacity(),
                            self.draft.free_tokens() if self.draft is not None else None) if c is not None]
        return min(caps) if caps else None

    def leak_report(self) -> list[str]:
        self._finish_deferred()
        proposer_report = getattr(self.proposer, "leak_report", None)  # (a draft model: `self.draft`'s)
        return (super().leak_report() + (proposer_report() if proposer_report is not None else [])
                + (self.shadow.leak_report() if self.shadow is not None else []))

    # -- the speculative decode step --------------------------------------------------------------
    def step(self, prefill: Sequence[tuple[Request, int]], decode: Sequence[Request]) -> StepResult:
        if self._pending:
            gap = time.perf_counter() - self._step_end
            pending, self._pending = self._pending, []
            for seconds, extend in pending:
                extend(gap if gap < seconds else 0.0)
        self._mixed = bool(prefill)
        self._upkeep = 0.0
        return super().step(prefill, decode)

    def _until_next_step(self, seconds: float, extend: Callable[[float], None]) -> None:
        """A measurement of this decode step (`seconds` long, filed already) is extended once
        the next step starts: `extend` gets the time from now to then (the scheduler's
        retirement of this step and its scheduling of the next, the caller's loop) where it
        is shorter than the step itself, else 0 (an idle engine, a new request's admission).
        A step's cost is what it holds the loop for, and a round holds it longer than its
        decode: it emits 2-3x the tokens to retire and reserves K + 1 positions a request
        when the next is scheduled (the dev CPU at W2, n-gram T=0, batch 32: ~150 us around
        a round against ~70 us around a plain step, not counted before)."""
        self._step_end = time.perf_counter()
        self._pending.append((seconds, extend))

    def _end_stretch(self, reserving: bool) -> None:
        """End the plain stretch under way (if any); `reserving`: the scheduler may be
        reserving the next step (requests reserved before now hold plain's one position, so
        that step is plain). Not after a generation's last finish: the next batch's first
        step then decided plainly and asked again, one more full choice a generation (H100,
        W2, run 24a)."""
        if self._stretch.active:
            self._plain_reserved = self._plain_reserved or reserving
            self._stretch.leave()

    def _end_episode(self) -> None:
        """The speculative episode under way (if any) ends: a standing all-plain decision took
        over, or the batch changes. The policy hears what it realized (spec/episodes.py)."""
        episode, self._episode = self._episode, None
        if episode is None:
            return
        outcome = episode.outcome(self.cost_model.step_seconds(episode.batch_size, 0, episode.sampled))
        if outcome is not None:
            self.policy.observe_episode(episode.batch_size, episode.sampled, *outcome)  # type: ignore[attr-defined]

    def _decode(self, requests: Sequence[Request]) -> StepResult:
        plain_reserved, self._plain_reserved = self._plain_reserved, False
        quiet = self._policy_quiet
        if quiet is not None and quiet(requests):  # a standing all-plain decision: the thin path
            if self._episode is not None:
                self._end_episode()
            start = self._plain_timer(requests)
            shadow = self.shadow
            if start is None and shadow is None:  # nothing to time or check: the plain step alone
                outputs = super()._decode(requests)
            else:
                outputs = self._plain_decode(requests, start)
                if shadow is not None and self._upkeep:
                    self._charge_upkeep(requests, self._upkeep)
            self._enter_stretch(requests)  # so are the next steps the decision holds
            return outputs
        if self._episode_gain is None and self._policy_charge is None:
            return self._speculative_decode(requests, plain_reserved)
        start, self._one_off = time.perf_counter(), 0.0
        outputs = self._speculative_decode(requests, plain_reserved)
        seconds = time.perf_counter() - start - self._one_off
        self._charge(requests, seconds, len(outputs))
        episode = self._episode  # (opened by this step's choice, or earlier)
        if episode is not None:
            episode.add(seconds, len(outputs), self._mixed)
            if episode.steps >= EPISODE_CHECK_STEPS and episode.losing(
                    self.cost_model.step_seconds(episode.batch_size, 0, episode.sampled)):
                self._end_episode()  # the policy hears it now, not at the next plain decision
            else:
                self._until_next_step(seconds, episode.extend)
        else:
            # a choice that kept the whole batch plain: the next steps it holds for are a plain
            # stretch at once (not after one more step on this path: H100, W2, the step after
            # a choice was one of ~5 a cycle at batch 17-32 outside stretches, ~0.4 ms dearer
            # than a stretch step each, run 23f). (With an episode open, the next step's thin
            # path ends it first, so that it counts the time up to that step.)
            self._enter_stretch(requests)
        return outputs

    def _charge(self, requests: Sequence[Request], seconds: float, tokens: int) -> None:
        """The loss ledger's account of a decode step the policy decided (spec/loss_ledger.py):
        its `seconds` (and, once the next step starts, the time it held the loop beyond them)
        less what plain decoding would have taken for its `tokens`. Not a step that ran
        prefill chunks too (its time is not its own)."""
        charge = self._policy_charge
        if charge is None or self._mixed or not requests:
            return
        batch, sampled = len(requests), batch_samples(requests)
        plain = self.cost_model.step_seconds(batch, 0, sampled)  # (its time between steps included)
        if plain is None:
            return
        charge(batch, sampled, seconds - tokens / batch * plain, plain)
        self._until_next_step(seconds, lambda gap: charge(batch, sampled, gap, plain))

    def _charge_upkeep(self, requests: Sequence[Request], seconds: float) -> None:
        """The loss ledger's account of shadow drafts' and tables' upkeep during plain steps:
        all of it is extra (plain decoding pays none)."""
        charge = self._policy_charge
        if charge is not None and not self._mixed and requests:
            charge(len(requests), batch_samples(requests), seconds)

    def _enter_stretch(self, requests: Sequence[Request]) -> None:
        """The steps after this one for which the standing all-plain decision holds (if any)
        run as a plain stretch, through the plain runner's methods."""
        left = self._quiet_left() if self._quiet_left is not None else 0
        if left:
            shadow = self.shadow
            self._stretch_shadowing = shadow is not None and self._shadowing(len(requests), batch_samples(requests))
            self._stretch_requests = requests  # (pruned by a finish the decision survives: `release`)
            if not self._stretch_shadowing and self._keep_quiet_without is not None:
                self._stretch_finishes = StretchFinishes.of(requests)
            # (a stretch without shadows needs no hooks: its steps are bare, `PlainStretch`)
            self._stretch.enter(left, hooks=self._stretch_shadowing)

    def _speculative_decode(self, requests: Sequence[Request], plain_reserved: bool = False) -> StepResult:
        start = time.perf_counter()
        holds = self._holds_quiet
        if plain_reserved or (holds is not None and any(holds(r) for r in requests)):
            # a request reserved one position (under the all-plain decision, or in a plain
            # stretch cut short while scheduling), but the batch is not that decision's (a
            # request joined or left): decode plainly, decide afresh next step
            self.policy.end_quiet()  # type: ignore[attr-defined]
            return self._plain_decode(requests, self._plain_timer(requests))
        seq_lens = [r.num_computed_tokens for r in requests]
        left = [r.tokens_left for r in requests]
        ks = self.policy.choose(requests, seq_lens, self.config.max_seq_len, left)
        if not any(ks):  # nobody speculates this step: exactly the plain decode step
            # timed from here: the plain baseline is what staying plain costs, a step of a
            # plain stretch, which asks no `choose` (30-120 us on the H100, 5-20 % of a
            # demo step: with it, rounds looked that much cheaper); a round pays its own
            return self._plain_decode(requests, self._plain_timer(requests))
        servable = self._servable
        if servable is not None and len(requests) > 1 and not any(
                k and servable(r) for r, k in zip(requests, ks, strict=True)):
            # no request given a draft length can draft now (n-gram: its table unbuilt,
            # queued by `ready`, or refused): no lookups, no episode, a plain step; each
            # counts as a miss (H100, W2 at T=0: learned starts at batch 32 for requests
            # whose tables were refused, ~2 one-step "episodes" a cycle at 2 plain steps'
            # time each, run 24e)
            for r, k in zip(requests, ks, strict=True):
                if k and self.policy.no_proposal(r.request_id) and self.shadow is not None:
                    self.shadow.watch(r.request_id)
            return self._plain_decode(requests, None)
        sampled = batch_samples(requests)  # costs are kept per sampling mode
        # speculation starts here (not a probe): an episode opens, whether or not the lookups
        # then find drafts (a step whose lookups all miss is part of what speculating costs:
        # the calibration's kappa is to catch misses too, spec/episodes.py; opening episodes
        # only on verified rounds, tried in the twenty-third pass, left that cost charged
        # nowhere, and n-gram rounds at T=1 came back at W2, H100 23g)
        gain = self._episode_gain() if self._episode is None and self._episode_gain is not None else None
        if gain is not None:
            self._episode = Episode(len(requests), sampled, gain)
        shadow = self.shadow
        if shadow is not None:
            shadow.take(self.proposer, requests, ks)
            self._shadows_taken(len(requests), sampled, 1)
        drafting = time.perf_counter()
        drafts = self.proposer.propose(requests, ks)
        switch = self.proposer.catch_up_seconds
        # one-offs (graph captures, a lone request's first n-gram table): timed nowhere
        setup = getattr(self.proposer, "setup_seconds", 0.0)
        self._one_off = setup
        drafting = time.perf_counter() - drafting - switch - setup
        longest = max(len(d.token_ids) for d in drafts)
        for r, k, d in zip(requests, ks, drafts, strict=True):
            # a miss the policy wants watched: looked up under plain forwards until a draft would come true
            if k and not d.token_ids and self.policy.no_proposal(r.request_id) and shadow is not None:
                shadow.watch(r.request_id)
        if not longest:
            # no proposals at all (n-gram found no match): a plain step, but not timed as one:
            # with the lookups' cost in it, it would bias the plain baseline (and speculation) up
            return self._plain_decode(requests, None, shadows_taken=True)
        if gain is not None:  # a round that verifies drafts starts speculation here
            self.policy.started(len(requests), sampled)  # type: ignore[attr-defined]
        outputs = self._accept(requests, drafts, self._verify(requests, drafts))
        if shadow is not None:
            shadow.check(requests)
        # the step ended in a host sync (tokens are on the host), so this is its real cost;
        # a draft catching up after plain steps is the cost of switching, recorded apart
        seconds = time.perf_counter() - start - switch - setup
        if self._mixed:  # prefill work in its time: filed nowhere
            return outputs
        if switch:
            self.cost_model.observe_switch(len(requests), switch, getattr(self.proposer, "catch_up_chunks", 1), sampled)
        self.cost_model.observe_draft(len(requests), longest, drafting, sampled)
        batch = len(requests)
        self.cost_model.observe(batch, longest, seconds, sampled)
        self._until_next_step(seconds, lambda gap: self.cost_model.extend_latest(batch, longest, gap, sampled))
        return outputs

    def _plain_timer(self, requests: Sequence[Request]) -> float | None:
        """Count a plain step outside a plain stretch; when it is to be timed, now (its start;
        a step the policy chose starts after the choice, see `_speculative_decode`).

        The plain baseline is a stretch step's cost: stretches time one of their steps in
        PLAIN_SAMPLE_EVERY (`_observe_plain`). Steps outside them sit next to rounds and
        choices, their host code cold (H100: the step after a round 17-25 % dearer than a
        stretch step; timing each one, as before, made rounds look cheap, and on W2 the
        policy speculated at batch 32 where rounds cost 2.5-5 plain steps). They are timed
        only for the first two plain steps, while the batch's bucket and mode have no fresh
        plain cost (a new batch size, an expired cost), and once PLAIN_RESAMPLE_EVERY plain
        steps went by without a sample (a policy speculating steadily)."""
        self._plain_steps += 1
        n = self._plain_steps
        if not self._mixed and (n <= 2 or n - self._plain_sampled_at >= PLAIN_RESAMPLE_EVERY
                                or not self.cost_model.has_plain(len(requests), batch_samples(requests))):
            return time.perf_counter()
        return None  # (beside prefill chunks a sample would not be filed: `_observe_plain`)

    def _observe_plain(self, requests: Sequence[Request], seconds: float) -> None:
        """A timed plain step (`_plain_decode`, or one in a plain stretch: see `PlainStretch`):
        the plain baseline in the batch's sampling mode (not a step that ran prefill chunks
        too: W2 on the H100 measured plain steps at 8-13 ms beside prefills, ~1.5 ms alone,
        and rounds looked free). Its shadow drafts and table upkeep are left out: the
        baseline is what plain decoding costs, and the upkeep is paid whichever is chosen
        (H200, n-gram at W2: stretch steps at batch 32 cost ~25 % more than plain decoding's,
        and a step that built 32 tables 23 ms: rounds looked cheap, and the episodes'
        calibration, measured against that baseline, could not see them lose).

        Alone (batch 1) the upkeep stays in: there it is not paid whichever is chosen, a
        request that speculates takes no shadow drafts, so leaving it out priced rounds up
        by it (H200, W5 at T=0, where it is ~25 % of a plain step: kappa fell to 0.4-0.7,
        rounds stopped in most instances, 1.0-1.06x against 1.97x before it was left out)."""
        if not self._mixed:
            batch, sampled = len(requests), batch_samples(requests)
            plain = seconds - (self._upkeep if batch > 1 else 0.0)
            self.cost_model.observe(batch, 0, plain, sampled)
            self._until_next_step(plain, lambda gap: self.cost_model.extend_latest(batch, 0, gap, sampled))
            self._plain_sampled_at = self._plain_steps + self._stretch.done

    def _finish_deferred(self, end: bool = True) -> None:
        """The bookkeeping of finishes a plain stretch took (`StretchFinishes`), in order: the
        standing decision's batch loses them (`keep_quiet_without`), and the proposer, the
        shadow drafts and the policy forget them. `end`: the stretch's record of its batch
        goes too (the stretch ended)."""
        finishes = self._stretch_finishes
        if finishes is None:
            return
        if end:
            self._stretch_finishes = None
        deferred, finishes.deferred = finishes.deferred, []
        keep = self._keep_quiet_without
        for request in deferred:
            if keep is not None:
                keep(request)
            if self.draft is None:  # (a draft model's was released with the slots: `release`)
                self.proposer.release(request)
            if self.shadow is not None:
                self.shadow.release(request.request_id)
            self.policy.release(request.request_id)

    def _stretch_done(self, steps: int) -> None:
        """A plain stretch ran `steps` steps: the policy and the plain-step count catch up, and
        the cost model hears what its shadow drafts and table upkeep cost a step (where they
        ran: `_stretch_shadows`)."""
        self._finish_deferred()
        self.policy.count_quiet_steps(steps)  # type: ignore[attr-defined]
        self._plain_steps += steps
        upkeep, self._stretch_upkeep = self._stretch_upkeep, 0.0
        requests, self._stretch_requests = self._stretch_requests, ()
        if not (steps and requests):
            return
        sampled = batch_samples(requests)
        if self._stretch_shadowing:
            self._shadows_taken(len(requests), sampled, steps)
        if upkeep:
            self.cost_model.observe_upkeep(len(requests), upkeep / steps, sampled)
            self._charge_upkeep(requests, upkeep)

    def _plain_decode(self, requests: Sequence[Request], start: float | None,
                      shadows_taken: bool = False) -> StepResult:
        """A step without drafts: the ContinuousRunner's decode step, shadow drafts taken while
        its forward is in flight (`_in_flight`; unless `shadows_taken`: the step was to
        speculate and took them before asking for proposals) and checked after. start: when
        the step began if it is timed as a plain step (`_plain_timer`), else None."""
        self._take_shadows = not shadows_taken
        outputs = super()._decode(requests)
        if self.shadow is not None:
            if start is None:  # (the upkeep is only left out of timed steps)
                self.shadow.check(requests)
            else:
                start_check = time.perf_counter()
                self.shadow.check(requests)
                self._upkeep += time.perf_counter() - start_check
        if start is not None:
            self._observe_plain(requests, time.perf_counter() - start)
        return outputs

    def _stretch_shadows(self, requests: Sequence[Request]) -> bool:
        """A plain stretch's step, in its `_in_flight`: check pending shadow drafts against
        the tokens of the steps before, take the due ones, and keep the proposer's tables
        up to date every KEEP_UP_EVERY steps and at the stretch's last (n-gram: so the round
        or lookup that ends the stretch catches up on few tokens before its forward). True
        when the evidence ended the all-plain decision (a request would speculate): the
        stretch ends after this step."""
        shadow = self.shadow
        assert shadow is not None
        if not self._stretch_shadowing:  # nothing could pay at this batch size: no upkeep either
            return False
        start = time.perf_counter()
        ended = bool(shadow.check(requests)) and not self._quiet_left()
        shadow.take(self.proposer, requests)
        stretch = self._stretch
        built = self._build_tables(requests)  # (the tables' updates too, in the same pass)
        if built is not None:
            start += built[0] - built[1]  # what the GPU's work hid is no upkeep
        elif self._keep_up is not None and (ended or not stretch.left or stretch.done % KEEP_UP_EVERY == 0):
            self._keep_up(requests)
        spent = time.perf_counter() - start
        self._upkeep += spent
        self._stretch_upkeep += spent
        return ended

    def _stretch_found(self, requests: Sequence[Request]) -> bool:
        """Right after a plain stretch's step: a watched request whose lookup's first token
        came true (`ShadowDrafts.check_found`) makes the policy ask at the next step, when
        the proposer has the rest of that draft (a step later it would need the next token
        to continue it too). True when that ended the all-plain decision."""
        shadow = self.shadow
        assert shadow is not None
        return bool(shadow.check_found(requests)) and not self._quiet_left()

    def _prefill_in_flight(self, requests: Sequence[Request]) -> None:
        """The proposer's per-request state (n-gram: the table of the prompt) is built while
        the prefill's forward runs, not before a decode step's forward (an adaptive runner's
        only while the GPU works: `_build_tables`; a fixed-K runner's whole, so that which
        requests can draft never depends on timing)."""
        if self._keep_up is not None and self._shadowing(self._held, batch_samples(requests)):
            self._keep_up(requests, self._build_watch())

    def _build_watch(self) -> Callable[[], bool] | None:
        """What table builds under a forward ask whether to go on (`keep_up`'s `busy`): an
        adaptive runner's, whether the GPU still works (`_busy`); a fixed-K runner's none, it
        builds whole (see `_build_tables`)."""
        return self._busy() if self.shadow is not None else None

    def _busy(self) -> Callable[[], bool] | None:
        """For table builds under a forward just queued (`keep_up`): whether the GPU still
        runs the work queued so far (a CUDA event recorded now, asked without waiting).
        None on a CPU, where the forward has run by now: the builds then run whole."""
        event = self._gpu_event
        if event is None:
            return None
        event.record()
        return lambda: not event.query()

    def _build_tables(self, requests: Sequence[Request]) -> tuple[float, float] | None:
        """Go on with the tables `keep_up` left part-built or `ready` queued (if any: else
        None), under this step's forward while the GPU works (`_busy`); returns the seconds
        spent and the part of them the GPU's work did not hide (from when it was first seen
        idle; all of it on a CPU, where the forward has run).

        Only that part is upkeep (`_in_flight`, `_stretch_shadows`): what hides under the
        forward costs no step, but where the host is the bottleneck nothing hides (n-gram at
        W2 on the demo pair, H100: the GPU idle before the builds start at batch 16-32, one
        chunk a step for a hundred steps, ~300 us of 1.4-2.8 ms steps) and, left out, the
        shadow gate kept shadows going where they could not pay, and the timed plain steps
        that carried the builds priced rounds down.

        A fixed-K runner (no shadows) builds the queued tables whole, whatever the GPU does:
        which requests can draft at a step must not depend on timing, or a seeded sampled
        request's tokens would (a round draws its uniforms otherwise than a plain step;
        H100, run 24a: a graphed and an eager engine parted ways). The adaptive policy
        decides from measured times anyway."""
        building = self._tables_building
        if building is None or not building():
            return None
        assert self._keep_up is not None
        start = time.perf_counter()
        busy = self._build_watch()
        if busy is None:
            self._keep_up(requests, None)
            spent = time.perf_counter() - start
            return spent, spent
        idle = None if busy() else start  # when the GPU was first seen idle

        def still_busy() -> bool:
            nonlocal idle
            if busy():
                return True
            if idle is None:
                idle = time.perf_counter()
            return False

        self._keep_up(requests, still_busy)
        end = time.perf_counter()
        return end - start, (end - idle if idle is not None else 0.0)

    def _table_pays(self, request: Request) -> bool:
        """The proposer's `admit` (n-gram): whether a table for a request that has none can pay
        for itself in the batch it decodes in (`AdaptivePolicy.table_pays`: its cost a
        token, measured on the proposer's builds, for the tokens it indexes and the tokens
        the request may still emit, against what speculation realized at this batch size)."""
        pays = self._policy_table_pays
        if pays is None:
            return True
        proposer = self.proposer
        left = min(request.tokens_left, self.config.max_seq_len - request.num_tokens)
        return pays(max(1, self._held), request_samples(request), max(0, left),
                    min(request.num_tokens, proposer.config.window), proposer.seconds_per_token)  # type: ignore[attr-defined]

    def _shadows_taken(self, batch_size: int, sampled: bool, steps: int) -> None:
        """`steps` decode steps of a batch of this size and sampling mode took shadow drafts:
        the policy counts them (`count_shadowed`: shadows pause where many steps took them
        and none led to speculation)."""
        count = self._count_shadowed
        if count is not None:
            count(batch_size, sampled, steps)

    def _shadowing(self, batch_size: int, sampled: bool) -> bool:
        """Whether shadow drafts and the proposer's upkeep run in a batch of `batch_size` and
        this sampling mode (the policy's `worth_shadowing`; a proposer's tables that skipped
        steps catch up at their next lookup)."""
        worth = self._worth_shadowing
        return worth is None or worth(batch_size, sampled)

    def _in_flight(self, requests: Sequence[Request]) -> None:
        """Shadow drafts (n-gram table upkeep and lookups) are taken while the plain step's
        forward runs: they read only the tokens the requests had before it. Without shadows
        (fixed K), tables that a batched lookup queued (`NgramProposer.propose`) are built
        here, under the forward."""
        if self.shadow is None:
            built = self._build_tables(requests)
            if built is not None:
                self._upkeep += built[1]
            return
        if not self._take_shadows:
            return
        batch, sampled = len(requests), batch_samples(requests)
        if self._shadowing(batch, sampled):
            self._shadows_taken(batch, sampled, 1)
            start = time.perf_counter()
            self.shadow.take(self.proposer, requests)
            self._upkeep += time.perf_counter() - start
            built = self._build_tables(requests)
            if built is not None:
                self._upkeep += built[1]  # (what the GPU's work did not hide)

    def _verify(self, requests: Sequence[Request], drafts: Sequence[Draft]) -> VerifyResult:
        """Target forward over [g, t_1..t_k] per request, then accept/reject (D4, D5)."""
        num_draft = [len(d.token_ids) for d in drafts]
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [k + 1 for k in num_draft])
        rows = [[r.last_token_id, *d.token_ids] for r, d in zip(requests, drafts, strict=True)]
        ids = torch.zeros((len(requests), layout.width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, :len(row)] = torch.tensor(row)
        params = [r.sampling_params for r in requests]
        k_pad = layout.width - 1
        draft_tokens = torch.zeros((len(requests), k_pad), dtype=torch.long)  # [B, K] CPU
        for i, d in enumerate(drafts):
            draft_tokens[i, :len(d.token_ids)] = torch.tensor(d.token_ids, dtype=torch.long)
        vocab = self.model.config.vocab_size
        if all(temperature_only(p, vocab) for p in params):
            greedy = [p.greedy for p in params]
            uniforms = (torch.zeros((len(requests), k_pad + 1), dtype=torch.float64) if all(greedy)
                        else draw_uniforms([r.generator for r in requests], k_pad + 1))  # [B, K+1]
            packed = self.forward.verify(ids, layout, draft_tokens, num_draft,
                                         self._draft_probs(drafts, draft_tokens, vocab),
                                         [1.0 if p.greedy else p.temperature for p in params], greedy, uniforms)
            self._build_tables(requests)  # (under the verification's forward, as under a plain step's)
            return unpack_rows(packed.tolist())  # the one host sync of verification
        logits = self.forward(ids, layout, all_logits=True)  # [B, K+1, V]
        self._build_tables(requests)
        return self._accept_reject(requests, drafts, draft_tokens, logits)

    def _draft_probs(self, drafts: Sequence[Draft], draft_tokens: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[B, K, V] draft distributions on the device, or None when every draft is
        deterministic (one-hot q); a deterministic row among model drafts gets a one-hot row."""
        if all(d.probs is None for d in drafts):
            return None
        b, k_pad = draft_tokens.shape
        draft_probs = torch.zeros((b, k_pad, vocab), dtype=torch.float32, device=self.device)
        for i, d in enumerate(drafts):
            k = len(d.token_ids)
            if d.probs is not None:
                draft_probs[i, :k] = d.probs
            elif k:
                draft_probs[i, torch.arange(k), draft_tokens[i, :k]] = 1.0
        return draft_probs

    def _accept_reject(self, requests: Sequence[Request], drafts: Sequence[Draft], draft_tokens: torch.Tensor,
                       target_logits: torch.Tensor) -> VerifyResult:
        """The general pipeline: each row's sampling transforms per position, then `verify`.
        draft_tokens: [B, K] on the host; target_logits: [B, K+1, V]."""
        num_draft = [len(d.token_ids) for d in drafts]
        b, width, vocab = target_logits.shape
        k_pad = width - 1
        params = [r.sampling_params for r in requests]
        contexts = None  # the growing context per verified position: only the repetition penalty reads it
        if any(p.repetition_penalty != 1.0 for p in params):
            contexts = [r.all_token_ids + d.token_ids[:j] for r, d in zip(requests, drafts, strict=True)
                        for j in range(width)]
        flat_params = [p for p in params for _ in range(width)]
        target_probs = logits_to_probs(target_logits.reshape(b * width, vocab), flat_params,
                                       contexts).view(b, width, vocab)
        draft_probs = self._draft_probs(drafts, draft_tokens, vocab)
        uniforms = to_device(draw_uniforms([r.generator for r in requests], k_pad + 1), self.device)
        return verify(draft_tokens, num_draft, draft_probs, target_probs, uniforms[:, :k_pad], uniforms[:, k_pad])

    def _accept(self, requests: Sequence[Request], drafts: Sequence[Draft], result: VerifyResult) -> StepResult:
        """Roll both caches back (D6), record metrics (D9), emit the tokens in order."""
        outputs: StepResult = []
        for r, d, tokens, a in zip(requests, drafts, result.tokens, result.num_accepted, strict=True):
            k = len(d.token_ids)
            n = r.num_computed_tokens
            self.cache_pool.truncate_to(r.slot, n + a + 1)
            r.num_computed_tokens = n + a + 1
            self.proposer.on_accepted(r, a)
            self.policy.update(r.request_id, k, a)
            if k > 0:
                r.speculation_acceptance_rates.append(a / k)
            emitted = 0
            for t in tokens:
                outputs.append((r, self.output.append(r, t)))
                emitted += 1
                if r.is_finished:
                    break
            r.spec_rounds += 1
            r.spec_tokens_emitted += emitted
            self.stats.record(k, a, emitted)
        return outputs

