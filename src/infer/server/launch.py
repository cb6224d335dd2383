"""Run an app under uvicorn: `serve_app` (foreground) and `ServerThread` (a background thread).

    with ServerThread(app) as server:          # 127.0.0.1, a free port chosen by the OS
        httpx.get(server.url + "/health")

On SIGTERM / Ctrl-C `DrainingServer` drains open requests; `LiveServer` bundles an engine, its app and the thread."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import uvicorn

from infer.server.config import ServerConfig, default_allowed_hosts
from infer.server.connections import BACKLOG, ensure_descriptors, guarded_protocol
from infer.server.listen import bind

BACKSTOP_S = 5.0  # uvicorn cancels what is left this long after the app's own shutdown timeout


class DrainingServer(uvicorn.Server):
    """A uvicorn server that tells the app when shutdown starts (the app's `state.server`)."""

    def __init__(self, config: uvicorn.Config, state: Any) -> None:
        super().__init__(config)
        self.state = state  # ServerState
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(self.state.overload.exception_handler)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.state.begin_shutdown)
        super().handle_exit(sig, frame)


def uvicorn_config(app: Any, log_level: str, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's settings for the app: the guarded h11 protocol (connections.py; the open-file limit
    raised to fit), the shutdown backstop."""
    state = app.state.server
    ensure_descriptors(state.config.max_connections)
    timeout = state.config.shutdown_timeout_s + BACKSTOP_S
    http = guarded_protocol(state.config.header_timeout_s, state.config.max_connections, state.overload)
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=int(timeout + 0.999),
                          backlog=BACKLOG, http=http, **kwargs)


def serve_app(app: Any, sock: socket.socket, log_level: str) -> None:
    """Serve on a socket from `bind` in the foreground until SIGTERM / SIGINT, then drain."""
    DrainingServer(uvicorn_config(app, log_level), app.state.server).run(sockets=[sock])


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = DrainingServer(uvicorn_config(app, log_level, lifespan="off"), app.state.server)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        """Start serving; returns once uvicorn accepts connections (RuntimeError if it cannot)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)  # polling uvicorn's startup flag
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut down as on SIGTERM (drain, then abort what is left) and join the thread."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class LiveServer:
    """An engine, its app and a ServerThread together: `LiveServer.start(EngineConfig(...))`;
    `leak_report()` lists any slot or KV block still held (empty when all is free)."""

    def __init__(self, engine: Any, app: Any, thread: ServerThread) -> None:
        self.engine = engine  # AsyncEngine
        self.app = app
        self.thread = thread

    @classmethod
    def start(cls, config: Any, model_name: str = "infer", max_queued_requests: int | None = None,
              engine: Any = None, **server_options: Any) -> LiveServer:
        """Start a server on 127.0.0.1 for `config` (an EngineConfig) or a built `engine`;
        `server_options` are further ServerConfig fields."""
        from infer.engine.async_engine import AsyncEngine
        from infer.engine.engine import Engine
        from infer.server.app import create_app

        server_options.setdefault("allowed_hosts", default_allowed_hosts("127.0.0.1"))
        server_config = ServerConfig(model_name=model_name, max_queued_requests=max_queued_requests,
                                     **server_options)
        async_engine = AsyncEngine(engine if engine is not None else Engine(config))
        try:
            app = create_app(async_engine, server_config)
            return cls(async_engine, app, ServerThread(app).start())
        except BaseException:
            async_engine.shutdown()
            raise

    @property
    def url(self) -> str:
        return self.thread.url

    @property
    def state(self) -> Any:  # ServerState
        return self.app.state.server

    def engine_idle(self) -> bool:
        box: list[bool] = []
        self.engine.run_sync(lambda: box.append(not self.engine.engine.has_unfinished()))
        return box[0]

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait (bounded) until no HTTP request is in flight and the engine is idle."""
        deadline = time.monotonic() + timeout_s
        while not (self.state.in_flight == 0 and self.engine_idle()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not settle within {timeout_s} s "
                                   f"({self.state.in_flight} HTTP requests in flight)")
            time.sleep(0.01)  # polling: requests are being aborted on the server threads

    def leak_report(self) -> list[str]:
        box: list[list[str]] = []
        self.engine.run_sync(lambda: box.append(self.engine.engine.leak_report()))
        return box[0]

    def stop(self) -> None:
        try:
            self.thread.stop()
        finally:
            self.state.close()
            self.engine.shutdown()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
