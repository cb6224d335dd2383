"""Finishes inside a plain stretch: what can wait for the stretch's end.

A request finishing while a plain stretch runs (engine/plain_stretch.py) used to pass
through the whole speculative `release`: the adaptive policy's `keep_quiet_without` (is
the all-plain decision still good for the rest?), the proposer's, the shadows' and the
policy's per-request state, then the plain runner's release. Run once after a step, cold,
that was ~60 us a finish more than plain decoding's release on the dev CPU (W2: 32
finishes a generation, most of them in stretches), the bulk of it the policy's code.

`StretchFinishes` holds what a stretch without shadow drafts needs to answer that question
itself: the ids of its batch (their number is its size, hence its cost bucket) and how
many of its requests sample. A finish that leaves the batch in that bucket and sampling mode (so
the decision stands as it is: `AdaptivePolicy.keep_quiet_without`'s first case) is
`take`n: the runner frees its target slot (and a draft slot, if it drafted) at once and
leaves the rest to `deferred`, done when the stretch ends, before the policy is asked
anything again. Any other finish (a bucket or mode change, a shadowing stretch, a
request that is not the stretch's) takes the runner's full path, which does the deferred
bookkeeping first; where the decision then holds for the rest, later finishes in the
stretch may wait again (`drop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.spec.costs import CostModel, request_samples

if TYPE_CHECKING:
    from collections.abc import Sequence

    from infer.engine.request import Request


@dataclass(slots=True)
class StretchFinishes:
    """A plain stretch's batch, for finishes that can wait for its end (module docstring)."""

    ids: set[int]  # id() of each request of the stretch's batch still in it
    samplers: int  # the batch's requests that sample
    deferred: list[Request] = field(default_factory=list)  # finishes taken, in order

    @classmethod
    def of(cls, requests: Sequence[Request]) -> StretchFinishes:
        return cls({id(r) for r in requests}, sum(map(request_samples, requests)))

    def drop(self, request: Request) -> None:
        """`request` left by the runner's full path and the decision held for the rest (in a
        smaller bucket, maybe): the batch is the rest."""
        key = id(request)
        if key in self.ids:
            self.ids.discard(key)
            self.samplers -= request_samples(request)

    def take(self, request: Request) -> bool:
        """Whether `request`'s finish leaves a rest of the batch, in its cost bucket and
        sampling mode; if so it is recorded (`deferred`) and no longer counts as the batch's."""
        key, size = id(request), len(self.ids)
        if key not in self.ids or size < 2 or CostModel.bucket(size - 1) != CostModel.bucket(size):
            return False
        samples = request_samples(request)
        if samples and self.samplers == 1:  # the batch's last sampler: its sampling mode changes
            return False
        self.ids.discard(key)
        self.samplers -= samples
        self.deferred.append(request)
        return True

