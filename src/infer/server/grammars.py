"""Compiling requests' grammars (structured outputs, forced tool calls) in worker processes,
before admission, so no compile runs on the event loop or the engine thread.

`GrammarService.compile(spec)`: from a byte-bounded cache, a compile under way, or a new one
within time and memory limits (400 beyond). Over `PENDING_PER_WORKER` compiles per worker: 429.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from pebble import ProcessExpired, ProcessPool

from infer.engine.engine import Engine
from infer.sampling import StructuredOutput
from infer.server.config import ServerConfig
from infer.server.errors import RATE_LIMIT, APIError, bad_request

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from infer.engine.structured import GrammarCache, Grammars


PENDING_PER_WORKER = 8  # compiles waiting or running per worker process, then 429
RETRY_AFTER_S = 5


class GrammarService:
    """The server's grammar compiler: worker processes, limits, a byte-bounded cache."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self._pool: ProcessPool | None = None
        self._cache: GrammarCache | None = None
        self._pending: dict[StructuredOutput, asyncio.Future[CompiledGrammar]] = {}

    async def compile(self, spec: StructuredOutput | None) -> CompiledGrammar | None:
        """The compiled grammar of `spec` (None for None); an APIError 400 when it cannot be had."""
        if spec is None:
            return None
        grammars = await asyncio.to_thread(self._grammars)  # (built once: it reads the vocabulary)
        if self._cache is None:
            from infer.engine.structured import GrammarCache
            self._cache = GrammarCache(self.config.grammar_cache_mib * 2**20)
        compiled = self._cache.get(spec)
        if compiled is not None:
            return compiled
        pending = self._pending.get(spec)
        if pending is None:
            most = PENDING_PER_WORKER * self.config.grammar_workers
            if len(self._pending) >= most:
                raise APIError(429, f"{most} grammars are being compiled for other requests: retry after "
                                    f"{RETRY_AFTER_S} s (or start the server with more --grammar-workers)", RATE_LIMIT,
                               None, "grammar_queue_full", {"Retry-After": str(RETRY_AFTER_S)})
            pending = asyncio.ensure_future(self._compile(grammars, spec))
            self._pending[spec] = pending
            pending.add_done_callback(lambda _: self._pending.pop(spec, None))
        return await asyncio.shield(pending)  # (a waiter that leaves does not end the compile)

    async def _compile(self, grammars: Grammars, spec: StructuredOutput) -> CompiledGrammar:
        serialized = await self.run_in_worker(spec)
        compiled = await asyncio.to_thread(grammars.load, serialized)
        assert self._cache is not None
        self._cache.put(spec, compiled)
        return compiled

    async def run_in_worker(self, spec: StructuredOutput) -> str:
        """`spec` compiled in a worker process (xgrammar's JSON), within the limits."""
        from infer.engine import grammar_worker

        memory = self.config.grammar_max_memory_mib * 2**20
        future = self._workers().schedule(grammar_worker.compile_serialized, args=(spec, memory),
                                          timeout=self.config.grammar_timeout_s)
        try:
            return await asyncio.wrap_future(future)
        except FutureTimeout:
            raise _too_complex(f"compiling this {spec.kind} grammar takes longer than this server's limit of "
                               f"{self.config.grammar_timeout_s:g} s", "--grammar-timeout", "grammar_timeout") from None
        except (MemoryError, ProcessExpired):
            raise _too_complex(f"compiling this {spec.kind} grammar needs more memory than this server's limit of "
                               f"{self.config.grammar_max_memory_mib} MiB", "--grammar-max-memory-mib",
                               "grammar_too_large") from None
        except ValueError as exc:
            raise bad_request(str(exc), None, "invalid_request") from None

    def _grammars(self) -> Grammars:
        try:
            return self.engine.grammars
        except ValueError as exc:
            raise bad_request(str(exc), None, "invalid_request") from None

    def start(self) -> None:
        """Start the worker processes now; ValueError when the model cannot have grammars."""
        self._workers()

    def _workers(self) -> ProcessPool:
        if self._pool is None:
            grammars = self.engine.grammars  # first: ValueError (naming the extra) when xgrammar is missing
            from infer.engine import grammar_worker

            # spawn, not fork: this process runs threads (the engine's, torch's) that a fork would copy mid-flight
            self._pool = ProcessPool(self.config.grammar_workers, initializer=grammar_worker.start,
                                     initargs=(grammars.token_table, grammars.vocab_size, grammars.eos_token_ids),
                                     context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (a compile under way is killed)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None


def _too_complex(what: str, flag: str, code: str) -> APIError:
    return bad_request(f"{what}: simplify it (fewer alternatives, optional properties or repetitions) or start the "
                       f"server with a larger {flag}", None, code)
