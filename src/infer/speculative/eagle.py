"""EagleProposer: drafts chains and static trees with an EAGLE / EAGLE-3 head (models/eagle.py) over its own KV pool.

The head is fed (f_i, t_{i+1}), f_i the target's captured features of position i. `observed` keeps each request's
pending features; `propose` feeds them (catch-up) and drafts over target ids, temperature-only rows as one
`head_round` (a CUDA graph on the GPU); `verifying` drafts greedy chains' next round ahead. Rounds ahead, rounds in
flight, prefix caching: docs/speculation.md, "An EAGLE head"; docs/architecture.md, "EAGLE heads"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.forward_batch import Row, plan_batch
from infer.models.capture import HiddenCapture
from infer.models.eagle import EagleHead
from infer.models.kernels.bundle import EAGER, Kernels
from infer.sampling import temperature_only
from infer.speculative.ahead import takes
from infer.speculative.chain_steps import ChainSteps, row_uniforms
from infer.speculative.draft_model import CATCH_UP_CHUNK, fed_positions, tree_draft
from infer.speculative.eagle_round import AheadFeed, EagerHeadRound, HeadRoundFn, head_pass
from infer.speculative.eagle_state import AheadMark, HeadState, moves
from infer.speculative.eagle_tree import expand_head_tree
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.pieces import Piece, split_pieces, stacked
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import Draft, RoundTokens, TreeShape
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol

FEED_MAX = 8  # the widest last feed of a fused round by default (the engine passes spec_length + 1)


class EagleProposer:
    def __init__(self, head: EagleHead, pool: CachePoolProtocol, capture: HiddenCapture,
                 round_fn: HeadRoundFn | None = None, feed_max: int = FEED_MAX, kernels: Kernels = EAGER) -> None:
        """round_fn: the fused round (`head_round`), eager by default; feed_max: the widest last
        feed it runs; kernels: the head's bundle for the observed features' fc and the default
        round (catch-ups, the general path and tree levels run EAGER)."""
        if feed_max < 1:
            raise ValueError(f"EagleProposer.feed_max must be >= 1, got {feed_max}")
        self.head, self.pool, self.capture = head, pool, capture
        self.device = next(head.parameters()).device
        self.states: dict[str, HeadState] = {}
        self.kernels = kernels
        self.round_fn: HeadRoundFn = round_fn if round_fn is not None else EagerHeadRound(head, pool, kernels)
        self.feed_max = feed_max
        # rounds of temperature-only rows run `round_fn` (False: always the general path, the tests' reference)
        self.fused = True
        self.fused_rounds = 0  # rounds run by `round_fn`
        # step counts `round_fn` holds graphs for: a shorter round runs the next one up (empty: its own length)
        self.round_steps: tuple[int, ...] = ()
        self.sharing = False  # prompt blocks shared through the pool's prefix cache (`share_prefixes`)
        # greedy chain rounds draft the next round under their verification (`verifying`)
        self.ahead = True
        self.ahead_rounds = 0  # rounds whose drafts (some rows' at least) were drafted ahead

    def share_prefixes(self) -> None:
        """Cache the head's prompt blocks (keyed with one token of lookahead) as the target caches its own."""
        self.pool.cache_prefixes(lookahead=1)
        self.sharing = True

    # -- features from the target ---------------------------------------------------------------
    @torch.inference_mode()
    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """`Proposer.observed`: keep the committed rows' features as pending (a round ahead's as it combined them)."""
        assert self.capture.last is not None, "the target ran without its hidden-state capture"
        fed = [self._fed_ahead(r, start, len(rs)) for r, start, rs in zip(requests, starts, rows, strict=True)]
        flat = [r for rs, piece in zip(rows, fed, strict=True) if piece is None for r in rs]  # (forward token indices)
        features = None if not flat else self.head.combine(
            self.capture.rows(tensor_on(flat, self.device, torch.long)), self.kernels)  # [M, H]
        at = 0
        for request, start, rs, piece in zip(requests, starts, rows, fed, strict=True):
            if not rs:
                continue
            if piece is None:
                assert features is not None
                piece, at = (features, at, at + len(rs)), at + len(rs)
            state = self.states.setdefault(request.request_id, HeadState())
            expected = self._cached(state) + state.num_pending()
            if start != expected:
                raise RuntimeError(f"EAGLE head of {request.request_id}: features of position {start} arrived, "
                                   f"position {expected} was expected next")
            state.pending.append(piece)

    def _fed_ahead(self, request: DraftRequest, start: int, n: int) -> Piece | None:
        """The features of n accepted rows from `start` as the round drafted ahead combined them, or None."""
        state = self.states.get(request.request_id)
        mark = None if state is None else state.ahead
        if state is None or mark is None or mark.accepted is None or state.pending \
                or start != mark.start or n != mark.accepted + 1:
            return None
        width = mark.steps + 1
        return mark.features, mark.row * width, mark.row * width + n

    def _cached(self, state: HeadState) -> int:
        """Positions the head holds for the request (drafted ahead: those it held before)."""
        if state.ahead is not None:
            return state.ahead.start
        return 0 if state.slot is None else self.pool.seq_len(state.slot)

    # -- memory ---------------------------------------------------------------------------------------
    def can_admit(self, request: DraftRequest) -> bool:
        return self.pool.can_allocate(request.prefill_target)

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        state = self.states.get(request.request_id)
        if state is None or (state.slot is None and not take):
            return True
        return self._grow(state, total_tokens)

    def pools(self) -> list[CachePoolProtocol]:
        return [self.pool]

    # -- shared prompt blocks (`share_prefixes`) ----------------------------------------------------
    def restorable(self, request: DraftRequest) -> int:
        """`PrefixRestorer.restorable`: the prompt tokens whose head blocks are cached."""
        if not self.sharing or not self.pool.can_allocate(0):
            return 0
        return self.pool.cached_prefix(request.prompt_token_ids)

    def restore(self, request: DraftRequest, tokens: int) -> None:
        """`PrefixRestorer.restore`: a slot holding the cached head blocks of the first `tokens`."""
        if tokens == 0:
            return
        if request.request_id in self.states:
            raise RuntimeError(f"EAGLE head of {request.request_id}: restored while it holds a state")
        slot = self.pool.allocate_slot(tokens, request.prompt_token_ids[:tokens + 1])
        if self.pool.seq_len(slot) != tokens:
            self.pool.free_slot(slot)
            raise RuntimeError(f"EAGLE head of {request.request_id}: {tokens} prompt tokens to restore, "
                               f"its cache holds {self.pool.seq_len(slot)}")
        self.states[request.request_id] = HeadState(slot)

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """Sharing prefixes: feed the prompt chunk's features but the last (its next token is not
        sampled yet) and register the full prompt blocks; else nothing."""
        if not self.sharing:
            return
        reqs, states = [], []
        for r in requests:
            s = self.states.get(r.request_id)
            if s is not None and s.num_pending() > 1 and self._grow(s, self._cached(s) + s.num_pending() - 1):
                reqs.append(r)
                states.append(s)
        if reqs:
            tails = self._feed(reqs, states, keep=1)[1]
            for s, tail in zip(states, tails, strict=True):
                s.pending = tail
            self._share(reqs, states)

    def _share(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState]) -> None:
        """Offer each request's full prompt blocks the head has fed to its prefix cache."""
        if self.sharing:
            for r, s in zip(reqs, states, strict=True):
                if s.slot is not None and not s.prompt_offered:
                    self.pool.register_prefix(s.slot, r.prompt_token_ids)
                    s.prompt_offered = self.pool.seq_len(s.slot) >= len(r.prompt_token_ids)

    def release(self, request: DraftRequest) -> None:
        state = self.states.pop(request.request_id, None)
        if state is not None and state.slot is not None:
            self.pool.free_slot(state.slot)

    def leak_report(self) -> list[str]:
        extra = [f"EAGLE head still holds requests {sorted(self.states)}"] if self.states else []
        return extra + [f"EAGLE head pool: {p}" for p in self.pool.leak_report()]

    def _room(self, request: DraftRequest, fed: int) -> HeadState | None:
        """The request's state with room for its catch-up and fed - 1 drafts; None (no draft this
        round) without features or room."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        return state if self._grow(state, request.num_computed_tokens + fed - 1) else None

    def _grow(self, state: HeadState, need: int) -> bool:
        """Whether the state's slot (taken now if it has none) has room for `need` positions."""
        if state.slot is None:
            if not self.pool.can_allocate(need):
                return False
            state.slot = self.pool.allocate_slot(need)
            return True
        return self.pool.ensure_capacity(state.slot, need)

    # -- proposing -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        """`Proposer.propose`: a chain or a static tree per request."""
        if len(depths) != len(requests):
            raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
        drafts = [Draft.empty(shape)] * len(requests)  # (frozen: one shared until a row's own replaces it)
        served = self._take_ahead(requests, shape, depths, drafts)
        picked = [(i, s) for i, k in enumerate(depths) if k > 0 and i not in served and (
            s := self._room(requests[i], fed_positions(shape, min(k, shape.depth)))) is not None]
        if not picked:
            return drafts
        reqs = [requests[i] for i, _ in picked]
        states = [s for _, s in picked]
        ks = [min(depths[i], shape.depth) for i, _ in picked]
        if not shape.is_chain:
            return self._tree(drafts, [i for i, _ in picked], reqs, states, ks, shape)
        steps = min((n for n in self.round_steps if n >= max(ks)), default=max(ks))
        fused = self._fusable(reqs, states, steps)
        if not fused and steps > max(ks):
            steps = max(ks)
            fused = self._fusable(reqs, states, steps)
        if fused:  # (its tokens stay on the device: verification feeds them to the target from there)
            tails = self._catch_up(reqs, states, keep=self.feed_max)[1]
            self._mark_round(reqs, states)
            on_device, probs = self._round(reqs, states, tails, ks, steps)
            self.fused_rounds += 1
            for j, ((i, _), k) in enumerate(zip(picked, ks, strict=True)):
                drafts[i] = Draft.chain_on_device(shape, on_device, j, k, None if probs is None else probs[j, :k])
            return drafts
        last = self._catch_up(reqs, states, keep=0)[0]  # [A, H]
        self._mark_round(reqs, states)
        tokens, probs = self._draft(reqs, states, ks, last)
        for j, ((i, _), k) in enumerate(zip(picked, ks, strict=True)):
            with isolated(reqs[j], DRAFTING):
                drafts[i] = Draft.chain(shape, tokens[j][:k], None if probs is None else probs[j, :k])
        return drafts

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        """`Proposer.can_follow`: every request's next chain of k was drafted ahead in one round
        (request b its row b) that can follow the round still in flight."""
        marks = [None if (s := self.states.get(r.request_id)) is None or s.slot is None or s.pending else s.ahead
                 for r in requests]
        first = marks[0] if marks else None
        return first is not None and all(
            m is not None and m.tokens is first.tokens and m.row == b and m.follows_in_flight(k, r.num_computed_tokens)
            for b, (r, m) in enumerate(zip(requests, marks, strict=True)))

    def _take_ahead(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int],
                    drafts: list[Draft]) -> set[int]:
        """Fill `drafts[i]` for the rows whose round drafted ahead matches what they draft now;
        the others drafted ahead give those positions back. Returns the rows served."""
        served: set[int] = set()
        for i, (r, k) in enumerate(zip(requests, depths, strict=True)):
            state = self.states.get(r.request_id)
            mark = None if state is None else state.ahead
            if state is None or mark is None or state.slot is None:
                continue
            state.ahead = None
            # (in flight: nothing pending, followed only when every row can; verified: features fed ahead)
            follow = mark.accepted is None
            if takes(mark, shape, k, r.num_computed_tokens, in_flight=not state.pending) \
                    and (follow or mark.start + state.num_pending() == mark.next_start):
                state.pending = []
                state.round_end = r.num_computed_tokens
                state.follows = (mark.counts, mark.row, mark.steps) if follow else None
                drafts[i] = Draft.chain_on_device(shape, mark.tokens, mark.row, k)
                served.add(i)
            else:
                mark.drop(self.pool, state.slot)
        self.ahead_rounds += bool(served)
        return served

    @torch.inference_mode()
    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """`Proposer.verifying`: draft the next round now for the greedy, grammar-free rows that
        drafted a chain of K = feed_max - 1, fed their block with the verdict's tokens."""
        if not self.ahead:
            return
        k = self.feed_max - 1
        picked = [i for i, (r, d) in enumerate(zip(requests, drafts, strict=True)) if self._aheadable(r, d, k)]
        if not picked:
            return
        if len(picked) < len(requests):
            verdict = verdict[tensor_on(picked, verdict.device, torch.long)]
        reqs, starts = [requests[i] for i in picked], [starts[i] for i in picked]
        states = [self.states[r.request_id] for r in reqs]
        width = k + 1
        if all(b == starts[0] + j * width for j, b in enumerate(starts)):  # (blocks end to end: nothing sent)
            index = torch.arange(starts[0], starts[0] + len(starts) * width, device=self.device)
        else:
            index = tensor_on([b + i for b in starts for i in range(width)], self.device, torch.long)
        features = self.head.combine(self.capture.rows(index), self.kernels)  # [B' (K + 1), H]
        accepted = verdict[:, k]  # [B']
        cols = torch.arange(width, device=verdict.device)
        ids = torch.where(cols[None, :] < accepted[:, None], verdict[:, :width], verdict[:, k + 1:])  # [B', K + 1]
        rows = [Row(s.slot, r.num_computed_tokens, [0] * width)  # type: ignore[arg-type]
                for r, s in zip(reqs, states, strict=True)]
        n = len(reqs)
        tokens, _ = self.round_fn(plan_batch(rows), features, k, [1.0] * n, torch.zeros((n, k), dtype=torch.float64),
                                  [True] * n, AheadFeed(ids.reshape(-1), accepted, moves(states)))
        drafted = RoundTokens(tokens.clamp(min=0))
        for j, (r, s) in enumerate(zip(reqs, states, strict=True)):
            s.ahead = AheadMark(drafted, j, k, r.num_computed_tokens, features=features, counts=accepted)

    def _aheadable(self, request: DraftRequest, draft: Draft, k: int) -> bool:
        """Whether the request's next round is drafted ahead (`verifying`); takes the room for it."""
        state, params = self.states.get(request.request_id), request.sampling_params
        need = request.num_computed_tokens + 2 * k  # (the block, then drafts up to K - 1 past it)
        return (draft.num_proposed == k and draft.shape.is_chain and request.grammar is None and params.greedy
                and temperature_only(params, self.head.config.vocab_size) and state is not None
                and state.slot is not None and not state.pending and state.round_end == request.num_computed_tokens
                and need <= self.pool.max_seq_len and self.pool.ensure_capacity(state.slot, need))

    def _tree(self, drafts: list[Draft], picked: Sequence[int], reqs: Sequence[DraftRequest],
              states: Sequence[HeadState], ks: Sequence[int], shape: TreeShape) -> list[Draft]:
        """A static tree per picked request (`drafts[picked[j]]`): the whole catch-up, then `expand_head_tree`."""
        root = self._catch_up(reqs, states, keep=0)[0]  # [A, H]
        self._mark_round(reqs, states)
        slots = [s.slot for s in states if s.slot is not None]  # (every picked row has one: `_room`)
        bases = [self.pool.seq_len(slot) - 1 for slot in slots]  # storage position of g's feed
        nodes, probs, drawn = expand_head_tree(self.head, self.pool, reqs, slots, bases, root, ks, shape)
        for j, (i, r, k) in enumerate(zip(picked, reqs, ks, strict=True)):
            with isolated(r, DRAFTING):
                drafts[i] = tree_draft(shape, k, nodes[j], drawn[j],
                                       None if probs is None or r.sampling_params.greedy else probs[j])
        return drafts

    def _mark_round(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState]) -> None:
        for r, s in zip(reqs, states, strict=True):
            s.round_end = r.num_computed_tokens

    def _fusable(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState], steps: int) -> bool:
        """Whether the round runs as one `head_round`: temperature-only rows, no grammar, room for `steps`."""
        if not self.fused:
            return False
        vocab = self.head.config.vocab_size
        if any(r.grammar is not None or not temperature_only(r.sampling_params, vocab) for r in reqs):
            return False
        for r, s in zip(reqs, states, strict=True):
            need = r.num_computed_tokens + steps - 1
            if need > self.pool.max_seq_len or not self.pool.ensure_capacity(s.slot, need):  # type: ignore[arg-type]
                return False
        return True

    def _round(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState], tails: Sequence[list[Piece]],
               ks: Sequence[int], steps: int) -> tuple[RoundTokens, torch.Tensor | None]:
        """The last feed (`tails`) and `steps` >= max k draft steps as one `head_round` -> (tokens
        [A, steps] on the device, q [A, steps, V] or None when every row is greedy)."""
        rows = [self._fed_row(r, s, sum(b - a for _, a, b in tail))
                for r, s, tail in zip(reqs, states, tails, strict=True)]
        params = [r.sampling_params for r in reqs]
        greedy = [p.greedy for p in params]
        uniforms = torch.zeros((len(reqs), steps), dtype=torch.float64)  # [A, steps]
        if not all(greedy):  # each row draws its own k_b (as the general path), the rest stay unread
            drawn = row_uniforms(reqs, ks)
            uniforms[:, :drawn.shape[1]] = drawn
        tokens, probs = self.round_fn(plan_batch(rows), stacked([p for tail in tails for p in tail]), steps,
                                      [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                      uniforms, greedy)
        # (a copy: a graph's output is rewritten by its next replay; NO_TOKEN becomes token 0)
        return RoundTokens(tokens.clamp(min=0)), probs

    def _fed_row(self, request: DraftRequest, state: HeadState, n: int) -> Row:
        """A flat row feeding n features from the end of the head cache, position p with t_{p+1}."""
        assert state.slot is not None
        start = self.pool.seq_len(state.slot)
        return Row(state.slot, start, request.token_slice(start + 1, start + 1 + n))

    def _catch_up(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState],
                  keep: int) -> tuple[torch.Tensor, list[list[Piece]]]:
        """A round's catch-up: `_feed` once the head holds every position the target does."""
        for r, s in zip(reqs, states, strict=True):
            cached = self._cached(s)
            if cached + s.num_pending() != r.num_computed_tokens or not s.pending:
                raise RuntimeError(f"EAGLE head of {r.request_id}: holds {cached} + {s.num_pending()} pending "
                                   f"positions, the target {r.num_computed_tokens}")
        return self._feed(reqs, states, keep)

    def _feed(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState],
              keep: int) -> tuple[torch.Tensor, list[list[Piece]]]:
        """Feed each request's pending features but the last `keep` -> (the head's output at each
        row's last fed position [A, H], zeros if none; the features left per row)."""
        assert all(s.slot is not None for s in states)
        dtype = states[0].pending[0][0].dtype
        feats, tails, lengths = [], [], []
        for s in states:
            n = s.num_pending()
            first, rest = split_pieces(s.pending, n - min(n, keep))
            feats.append(stacked(first) if first else None)
            lengths.append(n - min(n, keep))
            tails.append(rest)
            s.pending = []
        out = torch.zeros((len(reqs), self.head.spec.hidden_size), dtype=dtype, device=self.device)
        done = [0] * len(reqs)
        while True:
            todo = [b for b in range(len(reqs)) if done[b] < lengths[b]]
            if not todo:
                return out, tails
            rows, chunks = [], []
            for b in todo:
                n = min(CATCH_UP_CHUNK, lengths[b] - done[b])
                rows.append(self._fed_row(reqs[b], states[b], n))
                chunks.append(feats[b][done[b]:done[b] + n])  # type: ignore[index]
                done[b] += n
            x = head_pass(self.head, self.pool, plan_batch(rows), torch.cat(chunks))  # [T', H]: each row's last
            ends = [j for j, b in enumerate(todo) if done[b] == lengths[b]]
            if ends:
                out[tensor_on([todo[j] for j in ends], self.device, torch.long)] = x[tensor_on(ends, self.device,
                                                                                             torch.long)]

    def _draft(self, reqs: Sequence[DraftRequest], states: Sequence[HeadState], ks: Sequence[int],
               x: torch.Tensor) -> tuple[list[list[int]], torch.Tensor | None]:
        """k_b tokens per row from the catch-up's outputs x [A, H] -> (tokens [A][k_b], q [A, K, V]
        over target ids, or None when every row is greedy)."""
        batch, k_max = len(reqs), max(ks)
        chain = ChainSteps.of(reqs, k_max, self.device)
        uniforms = None if chain.greedy else to_device(row_uniforms(reqs, ks), self.device)  # [A, K]
        alive = list(range(batch))
        for step in range(k_max):
            rows = tensor_on(alive, self.device, torch.long)
            new, probs = chain.draw(self.head.logits(x), alive, None if uniforms is None else uniforms[rows, step])
            chain.put(rows, step, new, probs)
            keep = [i for i, b in enumerate(alive) if ks[b] > step + 1]
            if not keep:
                break
            alive = [alive[i] for i in keep]
            index = tensor_on(keep, self.device, torch.long)
            slots = [states[b].slot for b in alive]
            plan = plan_batch([Row(s, self.pool.seq_len(s), [0]) for s in slots])  # type: ignore[arg-type]
            x = head_pass(self.head, self.pool, plan, x.index_select(0, index), new.index_select(0, index))
        return chain.rows(ks), chain.probs

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """Drop the round's draft positions (the accepted tokens are fed again at the next catch-up);
        a request drafted ahead keeps what that round wrote past its accepted positions."""
        for request, path in zip(requests, paths, strict=True):
            state = self.states.get(request.request_id)
            if state is None or state.round_end is None or state.slot is None:
                continue
            if state.follows is not None:  # (the round after it already runs: the host's positions corrected)
                moved = state.follows[2] - len(path)
                state.follows, state.round_end = None, state.round_end - moved
                if state.ahead is not None:
                    state.ahead.start -= moved
                continue
            mark, held = state.ahead, self.pool.seq_len(state.slot)
            if mark is not None:
                mark.accepted = len(path)
                self.pool.truncate_to(state.slot, min(mark.start + len(path) + mark.steps, held))
            else:
                self.pool.truncate_to(state.slot, min(state.round_end, held))
            state.round_end = None
            self._share([request], [state])
