"""A draft model with another tokenizer, drafting in its own ids over the tokens it shares with
the target (`vocab_map.py`): `ForeignDraftProposer` wraps a `DraftModelProposer` over a
`MaskedForward` and a `DraftView` per request, and maps drafts and q to the target's ids.
docs/architecture.md, "A draft model with another vocabulary".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds
from infer.sampling import SamplingParams
from infer.speculative.draft_model import DraftModelProposer, fed_positions
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.node_tree import DynamicShape
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import Draft, TreeShape
from infer.speculative.vocab_map import VocabMap, probs_to_target

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol
    from infer.models.llama import LlamaForCausalLM
    from infer.speculative.forward import ForwardFn
    from infer.speculative.grammar_mask import GrammarState


class MaskedForward:
    """The draft's forward with the logits of ids the target lacks at -inf (`ForwardFn`)."""

    def __init__(self, forward: ForwardFn, allowed: torch.Tensor) -> None:
        self.forward = forward
        self.blocked = ~allowed  # [V_d] bool, on the draft's device

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        return self.forward.run(plan, device_ids).masked_fill(self.blocked, float("-inf"))  # [M, V_d]


class DraftTokens:
    """One request's tokens in the draft's ids: the target's known tokens, each expanded."""

    __slots__ = ("ids", "ends")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.ends: list[int] = []  # ends[i]: draft ids standing for the target's tokens 0..i

    def sync(self, vocab: VocabMap, request: DraftRequest) -> None:
        """Expand the target's tokens the host knows that are not expanded yet."""
        known = request.num_tokens - request.pending_tokens
        if known > len(self.ends):
            for token in request.token_slice(len(self.ends), known):
                self.ids.extend(vocab.expand(token))
                self.ends.append(len(self.ids))

    def length(self, n: int) -> int:
        """L(n): draft ids standing for the target's first n <= len(ends) tokens."""
        return self.ends[n - 1] if n else 0


class DraftView:
    """A request as the draft reads it: a `DraftRequest` in the draft's ids, its pending
    token the last draft id of the target's g. No grammar (it speaks the target's ids)."""

    def __init__(self, request: DraftRequest, tokens: DraftTokens) -> None:
        self.request = request
        self.tokens = tokens
        self.request_id: str = request.request_id
        self.sampling_params: SamplingParams = request.sampling_params
        self.slot: int | None = request.slot
        self.generator: torch.Generator = request.generator
        self.grammar: GrammarState | None = None
        self.pending_tokens = 0
        # -1: nothing of tokens[: n + 1] stands in the draft's ids (or g is not known yet)
        n = request.num_computed_tokens + 1
        self.num_computed_tokens = tokens.length(n) - 1 if n <= len(tokens.ends) else -1

    @property
    def fault(self) -> str | None:
        return self.request.fault

    @fault.setter
    def fault(self, message: str | None) -> None:
        self.request.fault = message

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens.ids[:self.tokens.length(min(len(self.request.prompt_token_ids), len(self.tokens.ends)))]

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.tokens.ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens.ids)

    @property
    def prefill_target(self) -> int:
        return self.tokens.length(min(self.request.prefill_target, len(self.tokens.ends)))

    def token_slice(self, lo: int, hi: int | None = None) -> list[int]:
        """The draft's ids [lo, hi), by default up to its pending token."""
        return self.tokens.ids[lo:self.num_computed_tokens + 1 if hi is None else hi]


class ForeignDraftProposer:
    """`Proposer` of a draft model whose vocabulary differs from the target's."""

    def __init__(self, inner: DraftModelProposer, vocab: VocabMap) -> None:
        self.inner = inner
        self.vocab = vocab
        source = vocab.probs_source().to(inner.device)  # [V_t] the draft id proposed as each target id, or -1
        self.source, self.missing = source.clamp(min=0), source < 0
        self.tokens: dict[str, DraftTokens] = {}  # request id -> its tokens in the draft's ids
        # the most draft ids a target token expands into (found at start, not in a step)
        self.longest_expansion = vocab.longest_expansion()

    @classmethod
    def build(cls, model: LlamaForCausalLM, pool: CachePoolProtocol, forward: ForwardFn,
              vocab: VocabMap) -> ForeignDraftProposer:
        """The draft model's proposer over `forward` masked to the shared tokens."""
        device = next(model.parameters()).device
        return cls(DraftModelProposer(model, pool, MaskedForward(forward, vocab.draft_allowed().to(device))), vocab)

    def view(self, request: DraftRequest) -> DraftView:
        tokens = self.tokens.setdefault(request.request_id, DraftTokens())
        tokens.sync(self.vocab, request)
        return DraftView(request, tokens)

    # -- proposing ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape | DynamicShape,
                depths: Sequence[int]) -> list[Draft]:
        views = [self.view(r) for r in requests]
        ks = [k if k > 0 and self._ready(v, shape, k) else 0 for v, k in zip(views, depths, strict=True)]
        drafts = []
        for request, draft in zip(requests, self.inner.propose(views, shape, ks), strict=True):
            n = len(draft.token_ids)
            mapped = Draft(draft.shape, (0,) * n, (False,) * n)  # (the request's fault: nothing drafted)
            with isolated(request, DRAFTING):
                mapped = self.to_target(draft)
            drafts.append(mapped)
        return drafts

    def _ready(self, view: DraftView, shape: TreeShape | DynamicShape, k: int) -> bool:
        """Whether the row can draft a round of depth k in the draft's ids: within max_seq_len, with room."""
        n = view.num_computed_tokens
        pool = self.inner.pool
        need = n + fed_positions(shape, k)
        if n < 0 or need > pool.max_seq_len:
            return False
        slot = self.inner.draft_slots.get(view.slot) if view.slot is not None else None
        if slot is None:
            return True  # (the round takes it: `DraftModelProposer.take_slot`)
        if pool.seq_len(slot) > n:  # g stands for no draft id: the draft's last one is fed again
            pool.truncate_to(slot, n)
        return pool.ensure_capacity(slot, need)

    def to_target(self, draft: Draft) -> Draft:
        """A draft in the draft's ids -> in the target's: tokens mapped, a node the target lacks absent
        with its descendants, q moved to the target's columns."""
        if not any(draft.valid):
            return draft
        parents = draft.shape.parents
        tokens: list[int] = []
        valid: list[bool] = []
        for node, (x, present) in enumerate(zip(draft.token_ids, draft.valid, strict=True)):
            t = self.vocab.draft_to_target[x] if present else -1
            ok = t >= 0 and (parents[node] < 0 or valid[parents[node]])
            tokens.append(t if ok else 0)
            valid.append(ok)
        probs = None if draft.probs is None else probs_to_target(draft.probs, self.source, self.missing)
        return Draft(draft.shape, tuple(tokens), tuple(valid), probs)

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        # (the inner proposer reads a request's id and slot, the same in either vocabulary)
        self.inner.on_accepted(requests, paths)

    # -- the rest of `Proposer` ----------------------------------------------------------------
    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """Nothing: the draft model drafts from the verified tokens on the host."""

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        return False  # (its drafts start from the verified tokens on the host)

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """Nothing: the draft prefills lazily, at a request's first round."""

    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """Nothing: the draft model reads tokens, not the target's states."""

    def can_admit(self, request: DraftRequest) -> bool:
        return self.inner.can_admit(request)

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        """`total_tokens` of the target's positions in the draft's: the expansion so far, a token still
        in flight at the longest expansion, the round's own tokens one for one."""
        tokens = self.view(request).tokens
        n = request.num_computed_tokens
        known = min(len(tokens.ends), n + 1)
        in_flight = (n + 1 - known) * (self.longest_expansion - 1)
        total = min(total_tokens + tokens.length(known) - known + in_flight, self.inner.pool.max_seq_len)
        return self.inner.ensure_capacity(request, total, take)

    def release(self, request: DraftRequest) -> None:
        self.inner.release(request)
        self.tokens.pop(request.request_id, None)

    def pools(self) -> list[CachePoolProtocol]:
        return self.inner.pools()

    def leak_report(self) -> list[str]:
        extra = [f"draft token map still holds requests {sorted(self.tokens)}"] if self.tokens else []
        return extra + self.inner.leak_report()
