"""Limits must be exact and shutdown must be bounded (shown with synchronisation, no clock):

- a queue limit of 100 admits 100 concurrent requests (each counted once), and refuses
  the next one while max_batch_size + 100 are open,
- on shutdown an open stream gets an error event and [DONE] once --shutdown-timeout has
  passed, and the server exits then rather than when the generation would have ended.

That preparation (parsing, tokenizing) does not stall /health is shown in
test_server_hardening.py, with a tokenizer held on an Event.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.waiting import wait_until
from infer import EngineConfig
from infer.engine.engine import Engine
from infer.server.launch import LiveServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=2)
    live = LiveServer.start(config, MODEL, max_queued_requests=100)
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def test_a_limit_of_100_admits_100_concurrent_requests(server: LiveServer) -> None:
    async def fire(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        return (await client.post("/v1/completions", json=body)).status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*(fire(client, i) for i in range(100)))

    for _ in range(3):
        codes = asyncio.run(run())
        assert codes.count(200) == 100, {c: codes.count(c) for c in set(codes)}


def test_the_request_beyond_the_cap_gets_429(server: LiveServer) -> None:
    """With the engine thread held, admitted requests stay queued: exactly max_batch_size +
    100 fit."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(120)

    holder = threading.Thread(target=server.engine.run_sync, args=(hold,))
    holder.start()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    try:
        assert entered.wait(30)
        capacity = server.state.capacity
        assert capacity == 2 + 100
        with ThreadPoolExecutor(capacity) as pool:
            queued = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=300)
                      for _ in range(capacity)]
            wait_until(lambda: server.state.open_choices >= capacity, 60, what=lambda: server.state.open_choices)
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            r = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60)
            assert r.status_code == 429
            release.set()
            assert [f.result().status_code for f in queued] == [200] * capacity
    finally:
        release.set()
        holder.join(60)


def test_shutdown_ends_open_streams_once_the_timeout_passed(ckpt_a: Path) -> None:
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu"))
    real_step = engine.step
    ended = threading.Event()  # the server's shutdown timeout has passed and ended the requests

    def step() -> Any:  # once shutdown began, no step runs until the timeout ended the request
        if live.state.shutting_down:
            assert ended.wait(60)
        return real_step()

    engine.step = step  # this engine instance only
    live = LiveServer.start(None, MODEL, engine=engine, shutdown_timeout_s=1.0)
    end_open_requests = live.state._end_open_requests

    def end_then_signal() -> None:
        end_open_requests()
        ended.set()

    live.state._end_open_requests = end_then_signal
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 480, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            stopper = threading.Thread(target=live.thread.stop)
            stopper.start()
            events += [line for line in lines if line.startswith("data: ")]
        stopper.join(60)
        assert not stopper.is_alive()  # the server exited after ending the request
    finally:
        ended.set()
        live.stop()
    assert not live.thread.thread.is_alive() and ended.is_set()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutdown" and "shut down" in error["message"]
    assert len(events) - 2 < 480  # it was cut short
    assert engine.leak_report() == []
