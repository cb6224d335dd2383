"""MedusaProposer: drafts chains and static trees with Medusa heads (Cai et al. 2024; models/medusa.py)
from the target's final hidden state of position n - 1, no extra pass and no cache; head d - 1
guesses depth d, one-hot. docs/speculation.md, "Medusa heads".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from infer.models.capture import HiddenCapture
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.medusa import MedusaHead
from infer.sampling import is_strict_int
from infer.speculative.faults import DRAFTING, isolated
from infer.speculative.proposer import DraftRequest
from infer.speculative.tree import Draft, TreeShape
from infer.transfer import tensor_on

if TYPE_CHECKING:
    from infer.cache.protocol import CachePoolProtocol


def medusa_draft(shape: TreeShape, depth: int, ranked: Sequence[int]) -> Draft:
    """One row's draft over `shape` down to `depth`: ranked concatenates head d's branching[d] best
    tokens for d = 0, 1, ...; a node at depth d, child c of its parent, takes head d - 1's c-th."""
    n = shape.num_nodes
    tokens, valid = [0] * n, [False] * n
    offsets = [sum(shape.branching[:d]) for d in range(depth)]
    for node in range(shape.level_starts[depth]):
        d = shape.depths[node] - 1
        child = (node - shape.level_starts[d]) % shape.branching[d]
        tokens[node], valid[node] = int(ranked[offsets[d] + child]), True
    return Draft(shape, tuple(tokens), tuple(valid))


class MedusaProposer:
    def __init__(self, head: MedusaHead, capture: HiddenCapture, kernels: Kernels = EAGER) -> None:
        """capture: the target's, of its final normed output; kernels: the heads' projections' bundle."""
        self.head, self.capture, self.kernels = head, capture, kernels
        self.device = next(head.parameters()).device
        self.last: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (position, hidden [H])

    @torch.inference_mode()
    def observed(self, requests: Sequence[DraftRequest], starts: Sequence[int],
                 rows: Sequence[Sequence[int]]) -> None:
        """`Proposer.observed`: keep each request's hidden state of its last committed row."""
        picked = [(r.request_id, start + len(rs) - 1, rs[-1])
                  for r, start, rs in zip(requests, starts, rows, strict=True) if rs]
        if not picked:
            return
        states = self.capture.rows(tensor_on([row for _, _, row in picked], self.device, torch.long))  # [R, H]
        for (request_id, position, _), state in zip(picked, states, strict=True):
            self.last[request_id] = (position, state)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], shape: TreeShape, depths: Sequence[int]) -> list[Draft]:
        """`Proposer.propose`: a chain (each head's argmax) or the static tree per request."""
        if len(depths) != len(requests):
            raise ValueError(f"depths must give one depth per request: got {len(depths)} for {len(requests)} requests")
        if any(not is_strict_int(k) or k < 0 for k in depths):
            raise ValueError(f"depths must hold integers >= 0, got {list(depths)}")
        drafts = [Draft.empty(shape)] * len(requests)  # (frozen: one shared until a row's own replaces it)
        picked = [i for i, (r, k) in enumerate(zip(requests, depths, strict=True)) if k > 0 and self._ready(r)]
        if not picked:
            return drafts
        ks = [min(depths[i], shape.depth) for i in picked]
        hidden = torch.stack([self.last[requests[i].request_id][1] for i in picked])  # [A, H]
        ranked = self.head.top_tokens(hidden, shape.branching[:max(ks)], self.kernels).tolist()  # [A, W]
        for i, k, row in zip(picked, ks, ranked, strict=True):
            with isolated(requests[i], DRAFTING):
                drafts[i] = medusa_draft(shape, k, row)
        return drafts

    def _ready(self, request: DraftRequest) -> bool:
        """Whether the kept state is of position n - 1 (the one whose logits gave g)."""
        kept = self.last.get(request.request_id)
        return kept is not None and kept[0] == request.num_computed_tokens - 1

    def on_accepted(self, requests: Sequence[DraftRequest], paths: Sequence[Sequence[int]]) -> None:
        """Nothing: the verification's accepted rows come through `observed`."""

    def verifying(self, requests: Sequence[DraftRequest], drafts: Sequence[Draft], starts: Sequence[int],
                  verdict: torch.Tensor) -> None:
        """Nothing: the heads read the accepted row's state (`observed`)."""

    def can_follow(self, requests: Sequence[DraftRequest], k: int) -> bool:
        return False  # (its drafts start from the verified tokens on the host)

    def prefilled(self, requests: Sequence[DraftRequest]) -> None:
        """Nothing: a prompt's last state comes through `observed`."""

    def release(self, request: DraftRequest) -> None:
        self.last.pop(request.request_id, None)

    def can_admit(self, request: DraftRequest) -> bool:
        return True  # one hidden state a request

    def ensure_capacity(self, request: DraftRequest, total_tokens: int, take: bool = False) -> bool:
        return True

    def pools(self) -> list[CachePoolProtocol]:
        return []

    def leak_report(self) -> list[str]:
        return [f"Medusa heads still hold the hidden states of {sorted(self.last)}"] if self.last else []
