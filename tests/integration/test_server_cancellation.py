"""A request with n > 1 choices whose client goes away, at whichever await point it goes,
leaves nothing behind: no choice in the engine, none counted by admission.

Each case drives the server's own path (`submit`, then `Jobs.outputs`) in an event loop and
cancels it at one await point, reached deterministically: the engine thread is held between
two commands (`run_sync` on an Event) so that an add is still on its way, or a step has not
run. The engine's state is read by a command queued after the cancellation's aborts, so it
sees exactly what the cancellation left.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing
from pathlib import Path

import pytest

from infer import EngineConfig, SamplingParams
from infer.engine.async_engine import AsyncEngine
from infer.engine.engine import Engine
from infer.sampling import StructuredOutput
from infer.server.config import ServerConfig
from infer.server.prepare import Prepared
from infer.server.serving import ServerState, submit

N = 4
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def state(ckpt_a: Path) -> Iterator[ServerState]:
    engine = AsyncEngine(Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=8, max_seq_len=256)))
    server = ServerState(engine, ServerConfig(model_name="tiny", max_queued_requests=64, max_running_choices=N))
    yield server
    server.close()
    engine.shutdown()


class EngineHold:
    """Holds the engine thread between two commands until `release` (bounded)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=engine.run_sync, args=(self._wait,), daemon=True)
        self.thread.start()  # (its command is queued now, behind whatever is queued already)

    def _wait(self) -> None:
        self.entered.set()
        assert self.released.wait(DEADLINE_S), "the engine hold was never released"

    async def entered_now(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, DEADLINE_S)

    def release(self) -> None:
        self.released.set()


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition()` (another thread's or task's progress), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.002)  # polling the engine thread's progress


def prepared(structured: StructuredOutput | None = None) -> Prepared:
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, ignore_eos=structured is None,
                             structured=structured) for i in range(N)]
    return Prepared([1, 2, 3, 4], params)


async def request(state: ServerState, body: Prepared, after_submit: Callable[[], Awaitable[None]] | None) -> None:
    _, jobs = await submit(state, body, "cancel")
    if after_submit is not None:
        await after_submit()
    async with aclosing(jobs.outputs()) as outputs:
        async for _ in outputs:
            pass


async def engine_report(engine: AsyncEngine) -> list[str]:
    """The engine's leaks, read by a command queued now (after every abort sent so far)."""
    box: list[list[str]] = []
    await asyncio.to_thread(engine.run_sync, lambda: box.append(engine.engine.leak_report()))
    return box[0]


async def cancel_at(state: ServerState, point: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    engine = state.engine
    holds: list[EngineHold] = []
    after_submit = None
    body = prepared()
    if point in ("adding the first choice", "awaiting its first token"):
        holds.append(EngineHold(engine))
        await holds[0].entered_now()
    elif point == "adding the other choices":
        async def hold_then_go() -> None:
            holds.append(EngineHold(engine))
            await holds[0].entered_now()
        after_submit = hold_then_go
    elif point == "compiling its grammar":
        gate = threading.Event()
        real = state.grammars.run_in_worker

        async def held(spec: StructuredOutput) -> str:
            holds.append(gate)  # type: ignore[arg-type]
            assert await asyncio.to_thread(gate.wait, DEADLINE_S)
            return await real(spec)
        monkeypatch.setattr(state.grammars, "run_in_worker", held)
        body = prepared(StructuredOutput(regex="[a-z]{4,}"))
    task = asyncio.ensure_future(request(state, body, after_submit))
    if point == "adding the first choice":
        await until(lambda: engine.num_queued() == 1)
    elif point == "awaiting its first token":
        await until(lambda: engine.num_queued() == 1)
        holds.append(EngineHold(engine))  # queued behind the add: no step runs after it
        holds[0].release()
        await holds[1].entered_now()
        await until(lambda: any(job.stream is not None for job in state.jobs))
    elif point == "adding the other choices":
        await until(lambda: engine.num_queued() == N - 1)
    elif point == "streaming":
        await until(lambda: sum(job.tracker is not None for job in state.jobs) >= 2)
    elif point == "compiling its grammar":
        await until(lambda: bool(holds))
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    report = asyncio.ensure_future(engine_report(engine))  # queued behind the aborts
    for hold in holds:
        hold.set() if isinstance(hold, threading.Event) else hold.release()
    return await report


@pytest.mark.parametrize("point", ["compiling its grammar", "adding the first choice", "awaiting its first token",
                                   "adding the other choices", "streaming"])
def test_every_choice_is_released_wherever_the_client_leaves(state: ServerState, point: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    leaks = asyncio.run(cancel_at(state, point, monkeypatch))
    assert leaks == []  # no request tracked, none waiting or running, every KV block free
    assert state.jobs == set() and state.reserved == 0  # admission counts nothing
    assert state.engine.num_queued() == 0 and state.engine.num_running() == 0
