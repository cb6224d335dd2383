"""Faults that belong to one request: its own work runs isolated, so an error there fails
that request alone and the batch goes on.

`isolated(request, stage)` wraps a request's share of a step (its grammar, its drafts, its
tokens' rendering): an exception marks the request (`fault`, the first one kept) and is
swallowed; the caller leaves the request's part of the step neutral (an empty draft, an
unmasked row, no token emitted), and the engine finishes the request with an error once
the step is done. Faults of the engine itself (a device error, a bug in batched code) are
never caught here.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Protocol

log = logging.getLogger("infer.engine")
DRAFTING = "drafting"  # the stage a proposer's per-request work is in


class Faultable(Protocol):
    request_id: str
    fault: str | None  # why the request failed (None: it has not)


def mark_fault(request: Faultable, message: str) -> None:
    """Record a fault of the request (the first one is the one reported)."""
    if request.fault is None:
        request.fault = message


class isolated:  # noqa: N801 - used as a function: `with isolated(request, stage):`
    """Run the request's own work; an Exception marks the request faulted (`stage` names what
    it was doing) and does not propagate. (A class, not a generator context manager: it
    wraps every emitted token, where a generator's set-up costs microseconds.)"""

    __slots__ = ("request", "stage")

    def __init__(self, request: Faultable, stage: str) -> None:
        self.request, self.stage = request, stage

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception):  # (none, or KeyboardInterrupt and the like: propagate)
            return False
        request, stage = self.request, self.stage
        if request.fault is None:  # (its first fault is logged and reported; later ones follow from it)
            log.warning("request %s failed while %s", request.request_id, stage, exc_info=(kind, exc, tb))
            mark_fault(request, f"request {request.request_id} failed while {stage}: {type(exc).__name__}: {exc}")
        return True
