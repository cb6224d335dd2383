"""AsyncEngine: the engine loop in a background thread, streams per request for asyncio.

`await add_request(...)` returns a stream of StepOutputs; `abort(request_id)` cancels before
the next step. Grammars are compiled off the engine thread. If a step raises, every open
stream gets an error event, `healthy` turns False, and later requests fail fast.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer.engine.engine import Engine
from infer.engine.request import Request, StepOutput
from infer.sampling import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger("infer.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]

    def put(self, out: StepOutput) -> None:
        if self.loop.is_closed():  # the consumer's event loop is gone: nobody to tell
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # closed between the check and the call
            pass


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _streams and _adding
        self._adding = 0  # add_request calls whose request the engine thread has not queued yet
        self.error: str | None = None
        self.on_step: Callable[[Engine, list[tuple[Request, StepOutput]]], None] | None = None
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and not self._stop.is_set()

    def num_queued(self) -> int:
        """Requests waiting for a slot: those on their way to the engine thread and those in the
        scheduler's waiting queue, each counted once."""
        with self._lock:
            return self._adding + len(self.engine.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    async def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                          compiled: CompiledGrammar | None = None) -> AsyncIterator[StepOutput]:
        """Queue (the engine thread validates); raises ValueError on bad input, RuntimeError when
        unhealthy. `compiled`: the grammar of params.structured, else compiled here first."""
        if not self.healthy:
            raise RuntimeError(f"engine is not running: {self.error or 'stopped'}")
        if params.structured is not None and compiled is None:
            compiled = await asyncio.to_thread(lambda: self.engine.grammars.compile(params.structured))
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: Exception | None) -> None:  # (event loop; the caller may have been cancelled)
            if not done.done():
                done.set_result(None) if error is None else done.set_exception(error)

        def add() -> None:
            try:
                with self._lock:
                    self._adding -= 1
                    if self.error is not None:
                        raise RuntimeError(f"engine is not running: {self.error}")
                    self.engine.add_request(prompt_token_ids, params, request_id, compiled)
                    self._streams[request_id] = stream
                loop.call_soon_threadsafe(settle, None)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(settle, exc)

        with self._lock:  # counted from here on (before the first await) by num_queued
            self._adding += 1
        self._submit(add)
        try:
            await done
        except asyncio.CancelledError:  # the engine thread adds it all the same: the abort queued after undoes it
            self.abort(request_id)
            raise
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:  # consumer went away (client disconnect, timeout, cancel)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do_abort() -> None:
            out = self.engine.abort(request_id)
            with self._lock:
                stream = self._streams.pop(request_id, None)
            if stream is not None and out is not None:
                stream.put(out)

        self._submit(do_abort)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if self.error is not None or not self.engine.has_unfinished():
                # idle, or dead after an error: keep answering commands (adds then fail fast)
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                results = self.engine.step()
            except Exception:  # noqa: BLE001 - the loop must report, not vanish
                self.error = traceback.format_exc(limit=5)
                log.error("engine step failed; failing every open request:\n%s", self.error)
                self._deliver(self.engine.fail_all("engine error: " + self.error.strip().splitlines()[-1]))
                continue
            self._deliver(results)
            if self.on_step is not None:
                self.on_step(self.engine, results)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # noqa: BLE001 - a bad command must not kill the engine thread
                traceback.print_exc()

    def _deliver(self, results: list[tuple[Request, StepOutput]]) -> None:
        with self._lock:
            for request, out in results:
                stream = self._streams.get(request.request_id)
                if stream is not None:
                    stream.put(out)
                if out.finished:
                    self._streams.pop(request.request_id, None)

    def run_sync(self, fn: Callable[[], object]) -> None:
        """Run fn on the engine thread (between steps) and wait for it (tests, leak checks)."""
        done = threading.Event()
        box: list[BaseException] = []

        def call() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001
                box.append(exc)
            finally:
                done.set()

        self._submit(call)
        done.wait()
        if box:
            raise box[0]

    def shutdown(self) -> None:
        """Stop the loop, then close the engine (its tensor-parallel workers end)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # (a step still running owns the engine: the finalizer closes it)
            self.engine.close()
