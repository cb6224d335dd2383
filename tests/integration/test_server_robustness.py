"""One request must not stall the others, limits must be exact, shutdown must be bounded.

- /health answers within 100 ms while a 5 MB prompt is being tokenized (measured on every
  probe sent while that request is in flight, against a server process of its own:
  tokenization runs off the event loop and the tokenizer releases the GIL),
- a queue limit of 100 admits 100 concurrent requests (each counted once), and refuses the
  101st while 100 wait,
- on shutdown an open stream gets an error event and [DONE] once --shutdown-timeout has
  passed, and the server exits then rather than when the generation would have ended.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.waiting import wait_until
from infer import EngineConfig
from infer.bench.server_load import start_server
from infer.engine.engine import Engine
from infer.server.launch import LiveServer

MODEL = "tiny"
HEALTH_LIMIT_S = 0.1


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=2)
    live = LiveServer.start(config, MODEL, max_queued_requests=100)
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


@pytest.fixture
def server_process(ckpt_a: Path) -> Iterator[str]:
    """`python -m infer.server` in its own process: its heap is a server's, not this test
    session's (whose full garbage collections can pause an in-process server for 0.5 s)."""
    proc, url = start_server(["--model", str(ckpt_a), "--device", "cpu", "--served-model-name", MODEL], 120,
                             capture_output=True)
    try:
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_health_answers_within_100ms_while_a_5mb_prompt_is_tokenized(server_process: str) -> None:
    prompt = ("def forward(self, input_ids): return self.lm_head(input_ids)  # The quick brown fox\n" * 70000)
    prompt = prompt[:5_000_000]
    result: dict[str, Any] = {}

    def big() -> None:
        result["response"] = httpx.post(server_process + "/v1/completions", timeout=300,
                                        json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        result["done"] = time.perf_counter()

    latencies: list[float] = []
    gc.collect()
    gc.freeze()  # this process's own garbage collections would count against the server
    try:
        with httpx.Client(base_url=server_process, timeout=30) as probe:
            assert probe.get("/health").status_code == 200  # connection open before the big request
            sender = threading.Thread(target=big)
            start = time.perf_counter()
            sender.start()
            while sender.is_alive():
                t0 = time.perf_counter()
                r = probe.get("/health")
                latencies.append(time.perf_counter() - t0)
                assert r.status_code == 200
            sender.join()
    finally:
        gc.unfreeze()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"  # it was tokenized
    assert result["done"] - start > 0.3, "the 5 MB prompt was handled too fast for the probes to mean anything"
    assert len(latencies) >= 5
    assert max(latencies) < HEALTH_LIMIT_S, sorted(latencies)[-5:]


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


def test_the_101st_waiting_request_gets_429(server: LiveServer) -> None:
    """With the engine thread held, admitted requests stay queued: exactly 100 fit."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(120)

    holder = threading.Thread(target=server.engine.run_sync, args=(hold,))
    holder.start()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    try:
        assert entered.wait(30)
        with ThreadPoolExecutor(100) as pool:
            queued = [pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=300)
                      for _ in range(100)]
            wait_until(lambda: server.state.queue_depth() >= 100, 60, what=server.state.queue_depth)
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            r = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60)
            assert r.status_code == 429
            release.set()
            assert [f.result().status_code for f in queued] == [200] * 100
    finally:
        release.set()
        holder.join(60)


def test_shutdown_ends_open_streams_within_the_timeout(ckpt_a: Path) -> None:
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu"))
    real_step = engine.step

    def slow_step() -> Any:  # a slow model: ~25 s for the request below
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step  # this engine instance only
    timeout = 1.0
    live = LiveServer.start(None, MODEL, engine=engine, shutdown_timeout_s=timeout)
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 480, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            stopper = threading.Thread(target=live.thread.stop)
            start = time.perf_counter()
            stopper.start()
            events += [line for line in lines if line.startswith("data: ")]
        stopper.join(60)
        elapsed = time.perf_counter() - start
    finally:
        live.stop()
    assert not live.thread.thread.is_alive()
    assert timeout <= elapsed < timeout + 4.0, elapsed  # not the ~25 s the generation needed
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutdown" and "shut down" in error["message"]
    assert len(events) - 2 < 480  # it was cut short
    assert engine.leak_report() == []
