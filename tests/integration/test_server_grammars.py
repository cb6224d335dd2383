"""Grammars compiled off the event loop and off the engine thread, within limits.

A compile held on an Event leaves /health, /metrics and plain requests answering; a compile
past `--grammar-timeout` or `--grammar-max-memory-mib` is a 400 naming the flag (its worker
killed, the next compile served by a fresh one); a grammar that accepts no string is a 400
before admission; beyond the compiles a worker may have waiting, a 429. (The cache bounded in bytes: tests/unit/test_structured.py.)
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("xgrammar")

from helpers.live import post as post_json, serving  # noqa: E402
from helpers.waiting import Gate, wait_until  # noqa: E402
from infer import EngineConfig  # noqa: E402
from infer.sampling import StructuredOutput  # noqa: E402
from infer.server.launch import LiveServer  # noqa: E402

# an enum of long strings: seconds to compile (a minute for 3,000 strings of 300 characters)
SLOW = {"enum": [f"{i:04d}" + "y" * 250 for i in range(700)]}


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=4, max_seq_len=512)
    yield from serving(LiveServer.start(config, "tiny", max_queued_requests=16, grammar_workers=1))


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return post_json(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, **body})


def test_health_metrics_and_plain_requests_answer_while_a_grammar_compiles(server: LiveServer,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    real = server.state.grammars.run_in_worker

    async def held(spec: StructuredOutput) -> str:
        await asyncio.to_thread(gate.wait)
        return await real(spec)

    monkeypatch.setattr(server.state.grammars, "run_in_worker", held)
    with ThreadPoolExecutor(1) as pool:
        guided = pool.submit(post, server, {"guided_regex": "[a-c]{3}x", "temperature": 0})
        try:
            assert gate.entered.wait(60)
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            assert httpx.get(server.url + "/metrics", timeout=60).status_code == 200
            plain = post(server, {"max_tokens": 16, "ignore_eos": True})
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 16
            assert not guided.done()  # still waiting for its grammar
        finally:
            gate.release()
        r = guided.result()
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-c]{3}x", r.json()["choices"][0]["text"])


@pytest.mark.parametrize("field", [{"guided_grammar": "root ::= root"}, {"guided_regex": r"[^\s\S]"},
                                   {"guided_grammar": 'root ::= item\nitem ::= item "a"'}])
def test_a_grammar_that_accepts_no_string_is_400_before_admission(server: LiveServer, field: dict[str, Any]) -> None:
    r = post(server, {**field, "temperature": 1e2})
    assert r.status_code == 400, r.text
    assert "accepts no string" in r.json()["error"]["message"]
    assert server.state.jobs == set() and server.engine.healthy


def test_a_compile_past_the_time_limit_is_400_naming_the_flag(server: LiveServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.state.config, "grammar_timeout_s", 0.1)
    r = post(server, {"guided_json": SLOW})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "grammar_timeout" and "--grammar-timeout" in r.json()["error"]["message"]
    monkeypatch.setattr(server.state.config, "grammar_timeout_s", 60.0)  # a fresh worker compiles the next
    ok = post(server, {"guided_choice": ["yes", "no"], "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")


def test_a_compile_past_the_memory_limit_is_400_naming_the_flag(server: LiveServer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.state.config, "grammar_max_memory_mib", 8)
    r = post(server, {"guided_json": SLOW})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_too_large" and "--grammar-max-memory-mib" in error["message"]
    monkeypatch.undo()
    assert post(server, {"guided_regex": "[0-9]{2}", "temperature": 0}).status_code == 200


def test_compiles_beyond_the_workers_queue_get_429(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.server.grammars import PENDING_PER_WORKER

    release = asyncio.Event()  # (awaited on the server's event loop: no thread held per compile)
    real = server.state.grammars.run_in_worker
    entered: list[StructuredOutput] = []

    async def held(spec: StructuredOutput) -> str:
        entered.append(spec)
        await release.wait()
        return await real(spec)

    monkeypatch.setattr(server.state.grammars, "run_in_worker", held)
    most = PENDING_PER_WORKER * server.state.config.grammar_workers
    with ThreadPoolExecutor(most + 1) as pool:
        waiting = [pool.submit(post, server, {"guided_regex": f"q{i}[a-z]", "temperature": 0}) for i in range(most)]
        try:
            wait_until(lambda: len(entered) == most)
            refused = post(server, {"guided_regex": "[0-9]", "temperature": 0})
            assert refused.status_code == 429 and refused.headers["Retry-After"]
            assert "--grammar-workers" in refused.json()["error"]["message"]
            same = pool.submit(post, server, {"guided_regex": "q0[a-z]", "temperature": 0})  # shares a compile
            assert post(server, {"max_tokens": 2}).status_code == 200  # no grammar: not affected
        finally:
            loop = server.thread.server.loop
            assert loop is not None
            loop.call_soon_threadsafe(release.set)
        assert all(r.result().status_code == 200 for r in waiting) and same.result().status_code == 200
    assert len(entered) == most  # the same spec shared its compile (or its cached result)
