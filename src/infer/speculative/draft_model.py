"""DraftModelProposer: drafts K tokens per request with a small model and its own KV pool.

Per request the draft cache holds a prefix of the request's tokens. A round for a request
whose target cache holds n tokens (the pending token g = tokens[n] not yet fed anywhere):

1. catch-up: tokens the draft has not seen, tokens[d : n], are fed first. On the first
   round this is the whole prompt (lazy draft prefill, spec D3); afterwards it is empty,
   the one token left over when every draft was accepted, or the tokens of plain steps taken
   in between (the adaptive policy's, or a batch above `spec_disable_batch_size`). Up to
   `max_feed - 1` of them ride along with step 1 (a chunk of up to `max_feed` tokens); longer catch-ups run as their own batched prefill.
2. K batched draft steps: step 1 feeds g, step i feeds t_{i-1}; each samples t_i from the
   draft distribution q_i after the request's sampling transforms (repetition penalty over
   the growing context, temperature, top-k, top-p) with the request's generator. Greedy
   rows take the argmax and report no probabilities (a one-hot q). When every row drafts
   the same k after a feed of the same width and samples with a temperature alone (greedy
   included), the K steps are one `draft_loop` call: on the GPU one CUDA graph replay, so a
   round pays the host work of one step rather than K (small draft models are bound by it).
3. after verification `on_accepted` rolls the draft cache back to n + a + 1 tokens (capped at
   what it actually holds, n + k), spec D6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.view import TRITON_MAX_CHUNK, BatchLayout
from infer.models.llama import LlamaForCausalLM
from infer.sampling import draw_uniforms, logits_to_probs, sample_from_probs, temperature_only
from infer.speculative import draft_tree
from infer.speculative.proposer import Draft
from infer.speculative.tree import TreeDraft, TreeShape
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.engine.executor import ForwardFn
    from infer.engine.request import Request

CATCH_UP_CHUNK = TRITON_MAX_CHUNK  # tokens per row per catch-up forward
DRAFT_MAX_FEED = 4  # widest first draft step (the runner captures CUDA graphs for widths 1..this)


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, step_forward: ForwardFn,
                 eager_forward: ForwardFn, max_feed: int = DRAFT_MAX_FEED) -> None:
        if max_feed < 2:
            raise ValueError(f"max_feed must be >= 2 (g plus the token left over by a full round), got {max_feed}")
        self.model = model
        self.max_feed = max_feed  # widest first draft step
        self.pool = pool
        # one draft step: (ids [B, T] CPU, layout, all_logits=False) -> last-token logits [B, V];
        # the engine passes a CUDA-graph runner here when graphs are on
        self.step_forward = step_forward
        # catch-up chunks without a graph: eager kernels (compiled ones would recompile for
        # every new width)
        self._eager = eager_forward
        self.device = next(model.parameters()).device
        self.draft_slots: dict[int, int] = {}  # target slot -> draft slot
        self.rounds: dict[str, tuple[int, int]] = {}  # request id -> (n, k) of the round in flight
        # draft rounds whose rows all draft the same k after a feed of one width run as one
        # `draft_loop` (False: always step by step, as the reference the tests compare with)
        self.fuse_rounds = True

    # -- memory: a draft slot from a request's first round on -------------------------------
    # A request gets its draft slot at its first round (`propose`), not at admission: one that
    # never drafts costs the draft pool nothing. Admission still asks whether the pool could
    # hold the prompt (`can_admit`).
    def can_admit(self, request: Request) -> bool:
        return self.pool.can_allocate(request.prefill_target)

    def pools(self) -> list[CachePoolProtocol]:
        return [self.pool]

    def prefilled(self, requests: Sequence[Request]) -> None:
        """Nothing: the draft prefills lazily, at a request's first round."""

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        """Room for positions < total_tokens in the request's draft cache; False (nothing
        taken) when the pool is short: the scheduler preempts. True for a request without a
        draft slot yet: its first round takes one if the pool has room then (`take_slot`)."""
        assert request.slot is not None
        slot = self.draft_slots.get(request.slot)
        return slot is None or self.pool.ensure_capacity(slot, total_tokens)

    def take_slot(self, request: Request, k: int) -> bool:
        """Whether the request has a draft slot for a round of k drafts, taken now at its
        first round (room for its context and the drafts); False when the pool has no room
        for it (prefix caching shares the target's prompt blocks, not the draft's): the
        request drafts nothing this round."""
        assert request.slot is not None
        if request.slot in self.draft_slots:
            return True
        need = request.num_computed_tokens + k
        if not self.pool.can_allocate(need):
            return False
        self.draft_slots[request.slot] = self.pool.allocate_slot(need)
        return True

    def release(self, request: Request) -> None:
        if request.slot is not None and request.slot in self.draft_slots:
            self.pool.free_slot(self.draft_slots.pop(request.slot))
        self.rounds.pop(request.request_id, None)

    def leak_report(self) -> list[str]:
        extra = [f"draft slot map still holds {self.draft_slots}"] if self.draft_slots else []
        return extra + [f"draft pool: {p}" for p in self.pool.leak_report()]

    def slot(self, request: Request) -> int:
        assert request.slot is not None
        return self.draft_slots[request.slot]

    # -- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft([], None) for _ in requests]
        active = [i for i, k in enumerate(ks) if k > 0 and self.take_slot(requests[i], k)]
        if not active:
            return drafts
        reqs = [requests[i] for i in active]
        k_of = [ks[i] for i in active]
        self.catch_up([r for r in reqs if self.behind(r)])
        tokens, probs = self._draft_loop(reqs, k_of)
        for j, i in enumerate(active):
            k = k_of[j]
            drafts[i] = Draft(tokens[j][:k], None if probs is None else probs[j, :k])
            self.rounds[reqs[j].request_id] = (reqs[j].num_computed_tokens, k)
        return drafts

    def behind(self, request: Request) -> bool:
        """Whether the draft misses more tokens than draft step 1 can feed (max_feed)."""
        return request.num_computed_tokens + 1 - self.max_feed > self.pool.seq_len(self.slot(request))

    def catch_up(self, reqs: Sequence[Request]) -> None:
        """Feed tokens[d : n+1-max_feed] as batched prefill chunks (step 1 feeds the rest).

        Chunks hold at most CATCH_UP_CHUNK tokens per row, so they stay on the Triton
        attention path: a longer chunk would go through SDPA, whose cuDNN backend plans
        every new shape (hundreds of milliseconds) and catch-up lengths rarely repeat.
        When the step function has a CUDA graph of that width (small batches), chunks are
        right-padded to it and replayed: an eager forward of a small model is launch-bound
        and costs many graph replays.
        """
        todo = list(reqs)
        while todo:
            slots = [self.slot(r) for r in todo]
            starts = [self.pool.seq_len(s) for s in slots]
            lens = [min(CATCH_UP_CHUNK, r.num_computed_tokens + 1 - self.max_feed - d)
                    for r, d in zip(todo, starts, strict=True)]
            layout = BatchLayout.of(slots, starts, lens)
            padded = BatchLayout.of(slots, starts, lens, width=CATCH_UP_CHUNK)
            graph = self.step_forward.captured(padded, False)
            if graph:
                layout = padded
            ids = torch.zeros((len(todo), layout.width), dtype=torch.long)
            for b, (r, d, n) in enumerate(zip(todo, starts, lens, strict=True)):
                ids[b, :n] = torch.tensor(r.token_slice(d, d + n))
            (self.step_forward if graph else self._eager)(ids, layout, all_logits=False)
            todo = [r for r in todo if self.behind(r)]

    def _draft_loop(self, reqs: Sequence[Request], ks: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Batched draft steps -> (tokens [B][k_b], probs [B, K, V], or None when every row is greedy).

        Step s runs the rows with k_b > s only, so no row writes past the positions its own
        k was guarded for. Tokens stay on the device between steps (the next step's input is
        the previous step's output): no host sync, except to grow the contexts when a
        repetition penalty needs them. Each row draws its k_b uniforms from its own generator.
        When every row samples with a temperature alone, the forward function samples too
        (`sample`: inside the step's CUDA graph when there is one).
        """
        batch, k_max = len(reqs), max(ks)
        slots = [self.slot(r) for r in reqs]
        params = [r.sampling_params for r in reqs]
        greedy = all(p.greedy and not p.penalized for p in params)
        contexts = [list(r.all_token_ids) for r in reqs] if any(p.penalized for p in params) else None
        vocab = self.model.config.vocab_size
        fused = None if greedy or not all(temperature_only(p, vocab) for p in params) else \
            self.step_forward.sample
        host_uniforms = None if greedy else _row_uniforms(reqs, ks)  # [B, K] CPU
        uniforms = None if greedy or fused else to_device(host_uniforms, self.device)  # [B, K]
        temps = [1.0 if p.greedy else p.temperature for p in params]
        tokens = torch.zeros((batch, k_max), dtype=torch.long, device=self.device)
        probs_out = None
        # step 1 feeds the unseen tail tokens[d : n+1] (1 token, 2 after an all-accepted round,
        # up to max_feed after plain steps)
        starts = [self.pool.seq_len(s) for s in slots]
        feeds = [r.token_slice(d) for r, d in zip(reqs, starts, strict=True)]
        lens = [len(f) for f in feeds]
        ids: torch.Tensor = torch.zeros((batch, max(lens)), dtype=torch.long)
        for b, f in enumerate(feeds):
            ids[b, :len(f)] = torch.tensor(f)
        if self.fuse_rounds and contexts is None and (greedy or fused is not None) and min(ks) == k_max \
                and min(lens) == max(lens):
            # every row drafts k_max tokens after a feed of the same width: the whole round is
            # one `draft_loop` (one CUDA graph replay on the GPU)
            union = BatchLayout.of(slots, starts, [lens[0] + k_max - 1] * batch)
            loop_uniforms = torch.zeros((batch, k_max), dtype=torch.float64) if greedy else host_uniforms
            loop_tokens, loop_probs = self.step_forward.draft_loop(ids, union, k_max, temps, loop_uniforms,
                                                                   [p.greedy for p in params])
            return [row[:k] for row, k in zip(loop_tokens.tolist(), ks, strict=True)], loop_probs
        alive = list(range(batch))
        rows = tensor_on(alive, self.device, torch.long)  # [A] batch rows still drafting
        for step in range(k_max):
            layout = BatchLayout.of([slots[b] for b in alive], [starts[b] for b in alive], [lens[b] for b in alive])
            probs = None
            if fused is not None:
                new, probs = fused(ids, layout, [temps[b] for b in alive], host_uniforms[alive, step],
                                   [params[b].greedy for b in alive])  # [A], [A, V]
            else:
                logits = self.step_forward(ids, layout, all_logits=False)  # [A, V]
                if greedy:
                    new = logits.argmax(dim=-1)  # [A]
                else:
                    sub = [params[b] for b in alive]
                    ctx = [contexts[b] for b in alive] if contexts is not None else None
                    probs = logits_to_probs(logits, sub, ctx)  # [A, V]
                    new = sample_from_probs(probs, uniforms[rows, step])
            if probs is not None:
                if probs_out is None:
                    probs_out = torch.zeros((batch, k_max, probs.shape[-1]), dtype=probs.dtype, device=self.device)
                probs_out[rows, step] = probs
            tokens[rows, step] = new
            if contexts is not None:
                for b, t in zip(alive, new.tolist(), strict=True):
                    contexts[b].append(t)
            for b in alive:
                starts[b] += lens[b]
                lens[b] = 1
            keep = [i for i, b in enumerate(alive) if ks[b] > step + 1]
            if len(keep) < len(alive):  # rows at their own k stop here
                alive = [alive[i] for i in keep]
                rows = tensor_on(alive, self.device, torch.long)
                new = new.index_select(0, tensor_on(keep, self.device, torch.long))
            ids = new[:, None]
        token_rows = tokens.tolist()  # the one sync of the draft phase
        return [row[:k] for row, k in zip(token_rows, ks, strict=True)], probs_out

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        n, k = self.rounds.pop(request.request_id, (None, 0))
        if n is None:
            return
        slot = self.slot(request)
        self.pool.truncate_to(slot, min(n + num_accepted + 1, self.pool.seq_len(slot), n + k))

    # -- tree speculation: the level-by-level expansion is in draft_tree.py ---------
    def propose_tree(self, requests: Sequence[Request], shape: TreeShape, depths: Sequence[int]) -> list[TreeDraft]:
        return draft_tree.propose_tree(self, requests, shape, depths)

    def on_tree_accepted(self, requests: Sequence[Request], paths: Sequence[Sequence[int]]) -> None:
        draft_tree.accept_paths(self, requests, paths)


def _row_uniforms(reqs: Sequence[Request], ks: Sequence[int]) -> torch.Tensor:
    """[B, max k] uniforms; row b draws exactly k_b from its own generator, so a seeded
    request's randomness does not depend on the rest of the batch."""
    out = torch.zeros((len(reqs), max(ks)), dtype=torch.float64)
    for b, (r, k) in enumerate(zip(reqs, ks, strict=True)):
        out[b, :k] = draw_uniforms([r.generator], k)[0]
    return out
