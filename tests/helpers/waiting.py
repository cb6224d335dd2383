"""Waiting on another thread's (or process's) progress: polling with a deadline instead of a sleep, and
a `Gate` that holds a call on an Event until the test releases it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], object], timeout_s: float = 30.0,
               what: Callable[[], object] | None = None) -> None:
    """Return once `condition()` is true; fail (showing `what()`, if given) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached: {what() if what else ''}"
        time.sleep(0.005)  # polling another thread's progress


class Gate:
    """Holds whatever calls `wait` until `release` (with a bound, so a failing test ends)."""

    def __init__(self) -> None:
        self.entered, self.released = threading.Event(), threading.Event()

    def wait(self) -> None:
        self.entered.set()
        assert self.released.wait(120), "the gate was never released"

    def release(self) -> None:
        self.released.set()


def held(fn: Callable[..., Any], gate: Gate, when: Callable[..., bool]) -> Callable[..., Any]:
    """`fn`, made to wait on `gate` first whenever `when(*args, **kwargs)`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            gate.wait()
        return fn(*args, **kwargs)
    return wrapper
