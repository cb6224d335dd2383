"""Polling another thread's (or process's) progress, with a deadline instead of a sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 30.0,
               what: Callable[[], object] | None = None) -> None:
    """Return once `condition()` is true; fail (showing `what()`, if given) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached: {what() if what else ''}"
        time.sleep(0.005)  # polling another thread's progress
