"""Faults that belong to one request: `isolated(request, stage)` runs its share of a step so that
an exception marks the request (`fault`) and is swallowed; the caller leaves its part neutral
and the engine finishes it with an error after the step. Engine faults are never caught here.
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
    it was doing) and does not propagate. (A class: it wraps every emitted token, kept cheap.)"""

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
