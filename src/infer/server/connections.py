"""Connection limits below the HTTP layer (uvicorn's h11 protocol), against clients that open
connections and never finish a request (slowloris) or open more than the server can hold.

`GuardedH11Protocol` closes a connection without complete headers `header_timeout_s` after it opened (or its
previous response), and any beyond `max_connections`; `ensure_descriptors` raises the open-file limit to fit.
docs/server.md, "Security and limits"."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from functools import partial
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LOG_INTERVAL_S = 10.0
BACKLOG = 1024  # the listen queue; also the connections asyncio accepts in one go
FD_RESERVE = 256  # descriptors kept for everything but client connections (model files, pipes, workers)
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"  # asyncio's message
log = logging.getLogger("infer.server")


class OverloadLog:
    """At most one warning per kind of overload per interval, counting what it stands for."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, kind: str, what: str) -> None:
        """One more event of `kind`; `what` says what happened (logged as "N x what")."""
        self._count[kind] = self._count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval_s) >= self.interval_s:
            log.warning("overload (%s): %s; %d time(s) since the last such line (one per %g s at most)", kind, what,
                        self._count[kind], self.interval_s)
            self._last[kind] = now
            self._count[kind] = 0

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The event loop's exception handler: accept() out of descriptors goes through `note`."""
        if context.get("message") == ACCEPT_OUT_OF_RESOURCES:
            self.note("accept", f"accept() failed: {context.get('exception')}")
        else:
            loop.default_exception_handler(context)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection limit."""

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int, overload: OverloadLog,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.overload = overload
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.overload.note("connections", f"connection closed at once: {self.max_connections} are open "
                                              "(--max-connections)")
            transport.abort()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_headers()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.overload.note("header_timeout", f"connection closed: no complete request headers within "
                                                 f"{self.header_timeout_s:g} s (--header-timeout)")
            self.transport.abort()


def guarded_protocol(header_timeout_s: float, max_connections: int, overload: OverloadLog) -> Any:
    """The `http` protocol factory to give uvicorn.Config."""
    return partial(GuardedH11Protocol, header_timeout_s=header_timeout_s, max_connections=max_connections,
                   overload=overload)


def ensure_descriptors(max_connections: int) -> None:
    """Raise this process's open-file limit to fit `max_connections`, a burst of accepts and a
    reserve; ValueError naming --max-connections when the hard limit does not allow it."""
    need = max_connections + BACKLOG + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max-connections {max_connections} needs {need} open files but this process may open "
                             f"at most {hard} (ulimit -Hn): lower --max-connections or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
