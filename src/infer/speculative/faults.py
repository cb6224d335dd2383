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
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def isolated(request: Faultable, stage: str) -> Iterator[None]:
    """Run the request's own work; an Exception marks the request faulted (`stage` names what
    it was doing) and does not propagate."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any error here is this request's alone
        if request.fault is None:  # (its first fault is logged and reported; later ones follow from it)
            log.warning("request %s failed while %s", request.request_id, stage, exc_info=True)
            mark_fault(request, f"request {request.request_id} failed while {stage}: {type(exc).__name__}: {exc}")
