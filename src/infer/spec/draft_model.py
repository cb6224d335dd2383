"""DraftModelProposer: drafts K tokens per request with a small model and its own KV pool.

Per request the draft cache holds a prefix of the request's tokens. A round for a request
whose target cache holds n tokens (the pending token g = tokens[n] not yet fed anywhere):

1. catch-up: tokens the draft has not seen, tokens[d : n], are fed first. On the first
   round this is the whole prompt (lazy draft prefill, spec D3); afterwards it is empty or
   the one token left over when every draft was accepted. Long catch-ups run as their own
   batched prefill; a catch-up of one token rides along with step 1 as a 2-token chunk.
2. K batched draft steps: step 1 feeds g, step i feeds t_{i-1}; each samples t_i from the
   draft distribution q_i after the request's sampling transforms (repetition penalty over
   the growing context, temperature, top-k, top-p) with the request's generator. Greedy
   rows take the argmax and report no probabilities (a one-hot q).
3. after verification `on_accepted` rolls the draft cache back to n + a + 1 tokens (capped at
   what it actually holds, n + k), spec D6.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.forward import EagerForward, ForwardFn
from infer.cache.protocol import CachePoolProtocol
from infer.cache.view import BatchLayout
from infer.models.llama import LlamaForCausalLM
from infer.sampling import draw_uniforms, logits_to_probs, sample_from_probs
from infer.spec.proposer import Draft

if TYPE_CHECKING:
    from infer.engine.request import Request



class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol,
                 step_forward: ForwardFn | None = None) -> None:
        self.model = model
        self.pool = pool
        # one draft step: (ids [B, T] CPU, layout, all_logits=False) -> last-token logits [B, V];
        # the engine passes a CUDA-graph runner here when graphs are on
        self.step_forward = step_forward or EagerForward(model, pool)
        self.device = next(model.parameters()).device
        self._draft_slots: dict[int, int] = {}  # target slot -> draft slot
        self._draft_prefilled: set[str] = set()  # request ids whose draft cache holds the prompt
        self._round: dict[str, tuple[int, int]] = {}  # request id -> (n, k) of the round in flight

    # -- memory, in lockstep with the target pool --------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        return self.pool.can_allocate(num_tokens)

    def allocate(self, request: Request, initial_tokens: int) -> None:
        assert request.slot is not None
        self._draft_slots[request.slot] = self.pool.allocate_slot(initial_tokens)

    def ensure_capacity(self, request: Request, total_tokens: int) -> bool:
        return self.pool.ensure_capacity(self._slot(request), total_tokens)

    def release(self, request: Request) -> None:
        if request.slot is not None and request.slot in self._draft_slots:
            self.pool.free_slot(self._draft_slots.pop(request.slot))
        self._draft_prefilled.discard(request.request_id)
        self._round.pop(request.request_id, None)

    def free_tokens(self) -> int | None:
        return self.pool.free_token_capacity()

    def leak_report(self) -> list[str]:
        extra = [f"draft slot map still holds {self._draft_slots}"] if self._draft_slots else []
        return extra + [f"draft pool: {p}" for p in self.pool.leak_report()]

    def _slot(self, request: Request) -> int:
        assert request.slot is not None
        return self._draft_slots[request.slot]

    # -- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        drafts = [Draft([], None) for _ in requests]
        active = [i for i, k in enumerate(ks) if k > 0]
        if not active:
            return drafts
        reqs = [requests[i] for i in active]
        k_of = [ks[i] for i in active]
        self._catch_up([r for r in reqs if r.num_computed_tokens - self.pool.seq_len(self._slot(r)) >= 2])
        tokens, probs = self._draft_loop(reqs, k_of)
        for j, i in enumerate(active):
            k = k_of[j]
            drafts[i] = Draft(tokens[j][:k], None if probs is None else probs[j, :k])
            self._round[reqs[j].request_id] = (reqs[j].num_computed_tokens, k)
        self._draft_prefilled.update(r.request_id for r in reqs)
        return drafts

    def _catch_up(self, reqs: Sequence[Request]) -> None:
        """Feed tokens[d : n-1] (all but the last unseen one) as a batched prefill."""
        if not reqs:
            return
        slots = [self._slot(r) for r in reqs]
        starts = [self.pool.seq_len(s) for s in slots]
        lens = [r.num_computed_tokens - 1 - d for r, d in zip(reqs, starts, strict=True)]
        layout = BatchLayout.of(slots, starts, lens)
        ids = torch.zeros((len(reqs), layout.width), dtype=torch.long)
        for b, (r, d, n) in enumerate(zip(reqs, starts, lens, strict=True)):
            ids[b, :n] = torch.tensor(r.all_token_ids[d:d + n])
        view = self.pool.view(layout)
        self.model(ids.to(self.device), layout.positions(self.device), view,
                   logits_indices=layout.last_token_indices(self.device))
        view.commit()

    def _draft_loop(self, reqs: Sequence[Request], ks: Sequence[int]) -> tuple[list[list[int]], torch.Tensor | None]:
        """K batched draft steps -> (tokens [B][K], probs [B, K, V], or None when every row is greedy).

        Tokens stay on the device between steps (the next step's input is the previous
        step's output), so the loop needs no host sync, except to grow the contexts when a
        repetition penalty needs them.
        """
        k_max = max(ks)
        slots = [self._slot(r) for r in reqs]
        params = [r.sampling_params for r in reqs]
        greedy = all(p.greedy and p.repetition_penalty == 1.0 for p in params)
        needs_ctx = any(p.repetition_penalty != 1.0 for p in params)
        contexts = [list(r.all_token_ids) for r in reqs] if needs_ctx else None
        uniforms = None if greedy else draw_uniforms([r.generator for r in reqs], k_max).to(self.device)
        # step 1 feeds the unseen tail tokens[d : n+1] (1 token, or 2 after an all-accepted round)
        starts = [self.pool.seq_len(s) for s in slots]
        feeds = [r.all_token_ids[d:] for r, d in zip(reqs, starts, strict=True)]
        lens = [len(f) for f in feeds]
        ids: torch.Tensor = torch.zeros((len(reqs), max(lens)), dtype=torch.long)
        for b, f in enumerate(feeds):
            ids[b, :len(f)] = torch.tensor(f)
        steps, all_probs = [], []
        for step in range(k_max):
            layout = BatchLayout.of(slots, starts, lens)
            logits = self.step_forward(ids, layout, all_logits=False)  # [B, V]
            if greedy:
                new = logits.argmax(dim=-1)  # [B]
            else:
                probs = logits_to_probs(logits, params, contexts)  # [B, V]
                new = sample_from_probs(probs, uniforms[:, step])
                all_probs.append(probs)
            steps.append(new)
            starts = [s + n for s, n in zip(starts, lens, strict=True)]
            lens = [1] * len(reqs)
            ids = new[:, None]
            if contexts is not None:
                for ctx, t in zip(contexts, new.tolist(), strict=True):
                    ctx.append(t)
        tokens = torch.stack(steps, dim=1).tolist()  # the one sync of the draft phase
        return tokens, (torch.stack(all_probs, dim=1) if all_probs else None)

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        n, k = self._round.pop(request.request_id, (None, 0))
        if n is None:
            return
        slot = self._slot(request)
        self.pool.truncate_to(slot, min(n + num_accepted + 1, self.pool.seq_len(slot), n + k))
