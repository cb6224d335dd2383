"""Streaming one request's text to a terminal, timed: what `infer generate` and `infer chat`
print while a model answers, and the speed line after it (`rate_summary`). Ctrl-C, caught
between steps, aborts the request and ends the stream.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from infer.engine.engine import Engine
    from infer.engine.request import Request


@dataclass(frozen=True)
class Streamed:
    """What a stream printed and when: start, first token (None: none came) and end, in
    `time.perf_counter` seconds."""

    text: str
    num_tokens: int
    start: float
    first: float | None
    end: float
    interrupted: bool = False


def stream_request(engine: Engine, request: Request, out: TextIO) -> Streamed:
    """Step `engine` until `request` finishes, writing its text to `out` as it comes."""
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    with _sigint_flag() as interrupted:
        while not request.is_finished and not interrupted.is_set():
            for r, step in engine.step():
                if r is not request:
                    continue
                if first is None and step.token_id is not None:
                    first = time.perf_counter()
                pieces.append(step.text_delta)
                out.write(step.text_delta)
                out.flush()
        if not request.is_finished:
            engine.abort(request.request_id)
    while engine.has_unfinished():  # (a step still in flight is rendered; nothing new starts)
        engine.step()
    return Streamed("".join(pieces), len(request.output_token_ids), start, first, time.perf_counter(),
                    interrupted.is_set())


@contextmanager
def _sigint_flag() -> Iterator[threading.Event]:
    """An Event set by Ctrl-C while the block runs (in the main thread; elsewhere it never is)."""
    flag = threading.Event()
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    except ValueError:  # not the main thread: signals stay where they are
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def rate_summary(n: int, start: float, first: float | None, end: float) -> str:
    """"[N tokens in T s (prefill P s), D tokens/s decode" (decode: tokens after the first over
    the time after it), without the closing bracket."""
    text = f"[{n} tokens in {end - start:.2f} s"
    if first is None:
        return text
    text += f" (prefill {first - start:.2f} s)"
    if n > 1 and end > first:
        text += f", {(n - 1) / (end - first):.1f} tokens/s decode"
    return text
