"""DraftModelProposer: drafts a chain or a tree per request with a small model and its own KV pool.

A round catches the draft cache up (lazy draft prefill), then drafts a chain by K batched steps, a static tree
level by level (`tree_expand`) or a dynamic tree (`dynamic_draft`). Chain rounds of greedy or unseeded rows draft
the next round ahead (`verifying`). The round step by step: docs/speculation.md, "A draft model".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.cache.compaction import PathMove, move_paths
from infer.cache.forward_batch import DeviceIds, Row, plan_batch
from infer.models.kernels.routes import DECODE_MAX_QUERY
from infer.models.llama import LlamaForCausalLM
from infer.sampling import temperature_only
from infer.speculative.ahead import AheadRound, takes
from infer.speculative.chain_steps import ChainSteps, row_uniforms
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.dynamic_draft import expand_dynamic
from infer.speculative.node_tree import DynamicShape, NodeTree
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import Draft, RoundTokens, TreeChunk, TreeShape
from infer.speculative.tree_expand import expand_levels
from infer.transfer import tensor_on, to_device

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.speculative.forward import ForwardFn

CATCH_UP_CHUNK = DECODE_MAX_QUERY  # tokens per row per catch-up pass (the split-KV kernel's rows; EAGLE's too)
DRAFT_MAX_FEED = 4  # widest first draft step


@dataclass
class DraftAhead(AheadRound):
    """The draft model's round drafted ahead (`DraftModelProposer.verifying`), with its q."""

    probs: torch.Tensor | None  # [B, steps, V] q of the round's rows (None: every row greedy)

    def kept(self) -> int:
        """Positions kept when dropped: those before `start`, once verified also the accepted ones (< n + a + 1)."""
        return self.start if self.next_start is None else self.next_start


class DraftModelProposer:
    def __init__(self, model: LlamaForCausalLM, pool: CachePoolProtocol, step_forward: ForwardFn,
                 max_feed: int = DRAFT_MAX_FEED) -> None:
        if max_feed < 2:
            raise ValueError(f"max_feed must be >= 2 (g plus the token left over by a full round), got {max_feed}")
        self.model = model
        self.max_feed = max_feed  # widest first draft step
        self.pool = pool
        self.step_forward = step_forward
        self.device = next(model.parameters()).device
        self.draft_slots: dict[int, int] = {}  # target slot -> draft slot
        # request id -> (n, per node its index in the draft's block where it was fed, or -1) of the round in flight
        self.rounds: dict[str, tuple[int, tuple[int, ...]]] = {}
        # greedy chain rounds draft the next round under their verification (`verifying`)
        self.ahead = True
        self.marks: dict[str, DraftAhead] = {}  # request id -> its next round, drafted ahead
        self.ahead_rounds = 0  # rounds whose drafts (some rows' at least) were drafted ahead

    # -- memory: a draft slot from a request's first round on -------------------------------
    # Taken when the scheduler first reserves a round (`ensure_capacity` with `take`), so a
    # seeded request's rounds never depend on what else holds the draft's memory.
    def can_admit(self, request: DraftRequest) -> bool:
        return self.pool.can_allocate(request.prefill_target)

    def pools(self) -> list[CachePoolProtocol]:
        return [self.pool]

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """Nothing: the draft model reads tokens, not the target's states."""

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """Nothing: the draft prefills lazily, at a request's first round."""

    @torch.inference_mode()
    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """`Proposer.verifying`: draft the next round now (verdict [B, K + 2] on the device) for the
        chain rows without a grammar, greedy or unseeded, whose draft has room; planned as if all k
        drafts were accepted, each row moved by a - k on the device (`DeviceIds.shift`)."""
        if not self.ahead:
            return
        picked = [i for i, (r, d) in enumerate(zip(requests, drafts, strict=True)) if self._aheadable(r, d)]
        if not picked:
            return
        if len(picked) < len(requests):
            verdict = verdict[tensor_on(picked, verdict.device, torch.long)]
        reqs = [requests[i] for i in picked]
        ks = [drafts[i].num_proposed for i in picked]
        width = verdict.shape[1] - 2
        k_row = tensor_on(ks, verdict.device, torch.long)  # [A]
        accepted = verdict[:, width]  # [A]
        last = verdict.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]  # [A] the last accepted draft
        g = tensor_on([r.token_slice(r.num_computed_tokens, r.num_computed_tokens + 1)[0] for r in reqs],
                      verdict.device, torch.long)
        first = torch.where(accepted > 0, last, g)
        ids = torch.stack([first, verdict[:, width + 1].clamp(min=0)], dim=1).reshape(-1)  # [2A]
        chain = self._draft_loop(reqs, ks, ahead=(ids, accepted - k_row))
        drafted = RoundTokens(chain.tokens.clamp(min=0))  # (a failed draw drafts token 0: its q judges it)
        for j, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            self.marks[r.request_id] = DraftAhead(drafted, j, k, r.num_computed_tokens, probs=chain.probs)

    def _aheadable(self, request: DraftRequest, draft: Draft) -> bool:
        """Whether the request's next round is drafted ahead (`verifying`); takes the room for it."""
        params, k, n = request.sampling_params, draft.num_proposed, request.num_computed_tokens
        slot = None if request.slot is None else self.draft_slots.get(request.slot)
        need = n + 2 * k + 1
        return (k > 0 and draft.shape.is_chain and request.grammar is None and (params.greedy or params.seed is None)
                and temperature_only(params, self.model.config.vocab_size) and slot is not None
                and self.rounds.get(request.request_id, (None,))[0] == n and self.pool.seq_len(slot) == n + k
                and need <= self.pool.max_seq_len and self.pool.ensure_capacity(slot, need))

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        return False  # (its cache lengths are the host's: each verdict is read before the next round)

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        """Room for positions < total_tokens in the request's draft cache (its slot taken now with
        `take`); False, nothing taken, when the pool is short."""
        assert request.slot is not None
        slot = self.draft_slots.get(request.slot)
        if slot is not None:
            return self.pool.ensure_capacity(slot, total_tokens)
        if not take:
            return True
        if not self.pool.can_allocate(total_tokens):
            return False
        self.draft_slots[request.slot] = self.pool.allocate_slot(total_tokens)
        return True

    def take_slot(self, request: DraftRequest, k: int) -> bool:
        """Whether the request has a draft slot for a round of k drafts (taken now if needed);
        False without room: it drafts nothing this round."""
        assert request.slot is not None
        if request.slot in self.draft_slots:
            return True
        need = request.num_computed_tokens + k
        if not self.pool.can_allocate(need):
            return False
        self.draft_slots[request.slot] = self.pool.allocate_slot(need)
        return True

    def release(self, request: DraftRequest) -> None:
        if request.slot is not None and request.slot in self.draft_slots:
            self.pool.free_slot(self.draft_slots.pop(request.slot))
        self.rounds.pop(request.request_id, None)
        self.marks.pop(request.request_id, None)

    def leak_report(self) -> list[str]:
        extra = [f"draft slot map still holds {self.draft_slots}"] if self.draft_slots else []
        extra += [f"rounds drafted ahead still held for {sorted(self.marks)}"] if self.marks else []
        return extra + [f"draft pool: {p}" for p in self.pool.leak_report()]

    def slot(self, request: DraftRequest) -> int:
        assert request.slot is not None
        return self.draft_slots[request.slot]

    # -- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape | DynamicShape,
                depths: Sequence[int]) -> list[Draft]:
        """`Proposer.propose`: a chain (`_draft_loop`), a static tree (`_expand`) or a dynamic tree
        (`expand_dynamic`) per request."""
        if len(depths) != len(requests):
            raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
        empty = Draft.empty(NodeTree((), shape.widths) if isinstance(shape, DynamicShape) else shape)
        drafts = [empty for _ in requests]
        served = self._take_ahead(requests, shape, depths, drafts)
        for i in served:
            self.rounds[requests[i].request_id] = (requests[i].num_computed_tokens, chain_fed(shape, depths[i]))
        active = [i for i, k in enumerate(depths) if k > 0 and i not in served
                  and self.take_slot(requests[i], fed_positions(shape, k))]
        if not active:
            return drafts
        reqs = [requests[i] for i in active]
        ks = [min(depths[i], shape.depth) for i in active]
        self.catch_up([r for r in reqs if self.behind(r)])
        storage: list[tuple[int, ...]] = []
        if isinstance(shape, DynamicShape):
            slots = [self.slot(r) for r in reqs]
            rows = expand_dynamic(self.step_forward, reqs, slots, self._feed_tail(reqs, slots), ks, shape)
            for i, r, row in zip(active, reqs, rows, strict=True):
                with isolated(r, DRAFTING):
                    drafts[i] = Draft(row.tree, row.tokens, (True,) * len(row.tokens),
                                      None if r.sampling_params.greedy else row.probs)
            storage = [row.storage for row in rows]
        elif shape.is_chain:
            chain = self._draft_loop(reqs, ks)
            probs = chain.probs
            if chain.greedy and not chain.host_bound:  # (left on the device: verification feeds them from there)
                on_device = RoundTokens(chain.tokens.clamp(min=0))
                for j, (i, k) in enumerate(zip(active, ks, strict=True)):
                    drafts[i] = Draft.chain_on_device(shape, on_device, j, k)
            else:
                tokens = chain.rows(ks)
                for j, (i, k) in enumerate(zip(active, ks, strict=True)):
                    with isolated(reqs[j], DRAFTING):
                        drafts[i] = Draft.chain(shape, tokens[j][:k], None if probs is None else probs[j, :k])
        else:
            nodes, probs, drawn = self._expand(reqs, ks, shape)
            for j, (i, r, k) in enumerate(zip(active, reqs, ks, strict=True)):
                with isolated(r, DRAFTING):
                    drafts[i] = tree_draft(shape, k, nodes[j], drawn[j],
                                           None if probs is None or r.sampling_params.greedy else probs[j])
        for j, (r, k) in enumerate(zip(reqs, ks, strict=True)):
            fed = storage[j] if storage else chain_fed(shape, k)
            self.rounds[r.request_id] = (r.num_computed_tokens, fed)
        return drafts

    def _take_ahead(self, requests: Sequence[DraftRequest], shape: TreeShape | DynamicShape,
                    depths: Sequence[int], drafts: list[Draft]) -> set[int]:
        """Fill `drafts[i]` for the rows whose round drafted ahead matches what they draft now;
        the others drafted ahead give those positions back. Returns the rows served."""
        served: set[int] = set()
        for i, (r, k) in enumerate(zip(requests, depths, strict=True)):
            mark = self.marks.pop(r.request_id, None)
            if mark is None or r.slot not in self.draft_slots:
                continue
            slot = self.slot(r)
            if takes(mark, shape, k, r.num_computed_tokens) \
                    and self.pool.seq_len(slot) == r.num_computed_tokens + mark.steps:
                probs = None if mark.probs is None else mark.probs[mark.row, :k]
                drafts[i] = Draft.chain_on_device(shape, mark.tokens, mark.row, k, probs)
                served.add(i)
            else:
                mark.drop(self.pool, slot)
        self.ahead_rounds += bool(served)
        return served

    def behind(self, request: DraftRequest) -> bool:
        """Whether the draft misses more tokens than draft step 1 can feed (max_feed)."""
        return request.num_computed_tokens + 1 - self.max_feed > self.pool.seq_len(self.slot(request))

    def catch_up(self, reqs: Sequence[DraftRequest]) -> None:
        """Feed tokens[d : n+1-max_feed] as batched prefill chunks of at most CATCH_UP_CHUNK tokens
        a row (step 1 feeds the rest)."""
        todo = list(reqs)
        while todo:
            rows = []
            for r in todo:
                slot = self.slot(r)
                d = self.pool.seq_len(slot)
                n = min(CATCH_UP_CHUNK, r.num_computed_tokens + 1 - self.max_feed - d)
                rows.append(Row(slot, d, r.token_slice(d, d + n), logits=0))
            self.step_forward.run(plan_batch(rows))
            todo = [r for r in todo if self.behind(r)]

    def _draft_loop(self, reqs: Sequence[DraftRequest], ks: Sequence[int],
                    ahead: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChainSteps:
        """Batched draft steps -> the round's `ChainSteps` (tokens [B, K] on the device, q [B, K, V]
        unless all greedy); step s runs the rows with k_b > s. `ahead` (ids [2B], shift [B]): a round
        drafted ahead, step 1 feeding each row two ids from the device, each row moved by its shift."""
        batch, k_max = len(reqs), max(ks)
        slots = [self.slot(r) for r in reqs]
        chain = ChainSteps.of(reqs, k_max, self.device)
        uniforms = None if chain.greedy else to_device(row_uniforms(reqs, ks), self.device)  # [B, K]
        # step 1 feeds the unseen tail tokens[d : n+1]; each later step the token the step before drew
        starts = [self.pool.seq_len(s) for s in slots]
        feeds: list[list[int]] = ([[0, 0] for _ in reqs] if ahead is not None
                                  else [r.token_slice(d) for r, d in zip(reqs, starts, strict=True)])
        alive = list(range(batch))
        rows = tensor_on(alive, self.device, torch.long)  # [A] batch rows still drafting
        new, shift = (None, None) if ahead is None else ahead  # [A] (step 1 of a round ahead: [2A])
        for step in range(k_max):
            plan = plan_batch([Row(slots[b], starts[b], feeds[b]) for b in alive])
            ids = None if new is None else DeviceIds(tuple(range(len(new))), new, shift=shift)
            logits = self.step_forward.run(plan, ids)
            new, probs = chain.draw(logits, alive, None if uniforms is None else uniforms[rows, step])  # [A]
            chain.put(rows, step, new, probs)
            for b in alive:
                starts[b] += len(feeds[b])
                feeds[b] = [0]  # (its id comes from the device)
            keep = [i for i, b in enumerate(alive) if ks[b] > step + 1]
            if len(keep) < len(alive):  # rows at their own k stop here
                alive = [alive[i] for i in keep]
                rows = tensor_on(alive, self.device, torch.long)
                index = tensor_on(keep, self.device, torch.long)
                new = new.index_select(0, index)
                shift = None if shift is None else shift.index_select(0, index)
        return chain

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """Move the fed part of each accepted path into sequence order, then truncate each slot to
        n + 1 + what it was fed of the path (capped at what it holds)."""
        moves: list[PathMove] = []
        ends: list[tuple[int, int]] = []
        for request, nodes in zip(requests, paths, strict=True):
            n, storage = self.rounds.pop(request.request_id, (None, ()))
            if n is None:
                continue
            fed: list[int] = []
            for node in nodes:  # (a fed node's parent was fed: the path's fed part is a prefix)
                if storage[node] < 0:
                    break
                fed.append(storage[node])
            slot = self.slot(request)
            moves.append(PathMove(slot, n, tuple(fed)))
            mark = self.marks.get(request.request_id)
            if mark is not None:  # (drafted ahead: its feed from n + a on is the next round's)
                mark.accepted = len(nodes)
            ends.append((slot, n + 1 + (len(fed) if mark is None else len(nodes) + mark.steps)))
        move_paths(self.pool, moves)
        for slot, end in ends:
            self.pool.truncate_to(slot, min(end, self.pool.seq_len(slot)))

    # -- trees: level by level -------------------------------------------------------------------
    def _feed_tail(self, reqs: Sequence[DraftRequest], slots: Sequence[int]) -> torch.Tensor:
        """A tree's level 0: one batched step over the unseen tail tokens[d : n + 1] (g last)
        -> the logits after g [A, V]."""
        rows = [Row(s, self.pool.seq_len(s), r.token_slice(self.pool.seq_len(s))) for r, s in zip(reqs, slots,
                                                                                              strict=True)]
        return self.step_forward.run(plan_batch(rows))

    def _expand(self, reqs: Sequence[DraftRequest], ks: Sequence[int],
                shape: TreeShape) -> tuple[list[list[int]], torch.Tensor | None, list[list[int]]]:
        """Levels 0 .. max(ks) - 1 (`tree_expand.expand_levels`), a level's state the draft's logits
        after each of its nodes."""
        slots = [self.slot(r) for r in reqs]

        def feed(d: int, alive: list[int], keep: list[int], level_tokens: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
            lo, hi = shape.level_starts[d], shape.level_starts[d + 1]
            rule = TreeChunk.level(shape, d + 1).rule()
            rows = [Row(slots[a], reqs[a].num_computed_tokens + 1 + lo, [0] * (hi - lo), logits=hi - lo, tree=rule)
                    for a in alive]
            ids = DeviceIds(tuple(range(len(alive) * (hi - lo))), level_tokens.reshape(-1))
            return self.step_forward.run(plan_batch(rows), ids).view(len(alive), hi - lo, -1)  # [A'', P, V]

        root = self._feed_tail(reqs, slots)[:, None]  # [A, 1, V]
        return expand_levels(reqs, ks, shape, self.device, root, lambda lg: lg.reshape(-1, lg.shape[-1]), feed)


def chain_fed(shape: TreeShape | DynamicShape, k: int) -> tuple[int, ...]:
    """Per node, its index in the draft's block where a round of depth k fed it (depth < k), or -1."""
    return tuple(i if depth < k else -1 for i, depth in enumerate(shape.depths))


def fed_positions(shape: TreeShape | DynamicShape, depth: int) -> int:
    """Positions a round of depth limit `depth` >= 1 writes to the draft's cache: g, then the nodes fed."""
    return 1 + shape.fed(depth)


def tree_draft(shape: TreeShape, k: int, tokens: Sequence[int], drawn: Sequence[int],
                probs: torch.Tensor | None) -> Draft:
    """A row's tree draft from its expanded nodes: present up to depth k where drawn and the parent is present."""
    n = shape.num_nodes
    valid = [False] * n
    for node in range(shape.level_starts[k]):
        parent = shape.parents[node]
        valid[node] = bool(drawn[node]) and (parent < 0 or valid[parent])
    return Draft(shape, tuple(t if ok else 0 for t, ok in zip(tokens, valid, strict=True)), tuple(valid), probs)
