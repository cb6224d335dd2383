"""Limits at the door: connections that never finish their headers are closed after the
header timeout, connections beyond the limit are closed at once (one log line per kind of
overload and interval), a large response is serialized without stalling other clients, a
generation POST that is not JSON gets 415, and the sampling bounds show in the schema.

"Closed" is read off the socket (recv returns at the close); "without stalling" is shown by
holding the large response's serialization on an Event while other requests are answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.live import post, serving
from helpers.waiting import Gate, held, wait_until
from infer import EngineConfig, SamplingParams
from infer.server import prepare as prepare_module
from infer.server.connections import ACCEPT_OUT_OF_RESOURCES, OverloadLog
from infer.server.launch import LiveServer

MODEL = "tiny"


def start(ckpt: Path, **options: Any) -> LiveServer:
    config = EngineConfig(model=str(ckpt), device="cpu", max_batch_size=4, max_seq_len=256)
    return LiveServer.start(config, MODEL, max_queued_requests=16, **options)


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    yield from serving(start(ckpt_a, header_timeout_s=0.5))


def connect(server: LiveServer, sent: bytes = b"") -> socket.socket:
    sock = socket.create_connection((server.thread.host, server.thread.port), timeout=60)
    if sent:
        sock.sendall(sent)
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Reads (and drops) what the server sends until it closes the connection: True, or
    raises socket.timeout after 60 s of silence."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def open_connections(live: LiveServer) -> int:
    return len(live.thread.server.server_state.connections)


# -- slowloris ---------------------------------------------------------------------------------------------

def test_connections_that_never_finish_their_headers_are_closed(ckpt_a: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    live = start(ckpt_a, header_timeout_s=0.5)  # (its own server: a fresh log interval)
    try:
        partial = [connect(live, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(6)]
        silent = [connect(live) for _ in range(2)]
        with caplog.at_level(logging.WARNING, logger="infer.server"):
            assert all(closed_by_server(sock) for sock in partial + silent)
        assert httpx.get(live.url + "/health", timeout=60).status_code == 200
        lines = [r for r in caplog.records if "overload (header_timeout)" in r.getMessage()]
        assert len(lines) == 1 and "--header-timeout" in lines[0].getMessage()  # one line for the eight
    finally:
        live.stop()


def test_a_keep_alive_connection_gets_the_header_timeout_for_its_next_request(server: LiveServer) -> None:
    sock = connect(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's headers never end
    assert closed_by_server(sock)


def test_connections_beyond_the_limit_are_closed_at_once(ckpt_a: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = start(ckpt_a, max_connections=4, header_timeout_s=120)
    try:
        held_open = [connect(live) for _ in range(4)]
        wait_until(lambda: open_connections(live) == 4)
        with caplog.at_level(logging.WARNING, logger="infer.server"):
            assert all(closed_by_server(connect(live)) for _ in range(3))
        held_open.pop().close()
        wait_until(lambda: open_connections(live) == 3)
        assert httpx.get(live.url + "/health", timeout=60).status_code == 200  # room again
        lines = [r for r in caplog.records if "overload (connections)" in r.getMessage()]
        assert len(lines) == 1 and "--max-connections" in lines[0].getMessage()
        for sock in held_open:
            sock.close()
    finally:
        live.stop()


def test_accept_out_of_descriptors_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    overload = OverloadLog(interval_s=3600)
    loop = asyncio.new_event_loop()
    others: list[dict[str, Any]] = []
    loop.default_exception_handler = others.append  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="infer.server"):
            for _ in range(1000):
                overload.exception_handler(loop, {"message": ACCEPT_OUT_OF_RESOURCES,
                                                  "exception": OSError(24, "Too many open files")})
            overload.exception_handler(loop, {"message": "something else"})
    finally:
        loop.close()
    lines = [r.getMessage() for r in caplog.records if "overload (accept)" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0]  # one line for the thousand
    assert others == [{"message": "something else"}]  # anything else goes to asyncio's own handler


# -- a large response does not stall others ------------------------------------------------------------------

def test_other_requests_answer_while_a_large_response_is_serialized(server: LiveServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate()
    fmt = server.state.logprob_format
    monkeypatch.setattr(fmt, "completion", held(fmt.completion, gate, lambda *a, **k: True))
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(post, server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "n": 3,
                                                              "logprobs": 5, "ignore_eos": True})
        try:
            assert gate.entered.wait(60)  # its first choice is being serialized
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            plain = post(server, "/v1/completions", {"prompt": [4, 5], "max_tokens": 4})
            assert plain.status_code == 200 and len(plain.json()["choices"]) == 1
            assert not large.done()
        finally:
            gate.release()
        r = large.result()
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 24


# -- 415 for bodies that are not JSON ------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_generation_post_that_is_not_json_is_415_unread(server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                          path: str, content_type: str | None) -> None:
    parsed: list[bytes] = []
    monkeypatch.setattr(prepare_module, "parse_body", lambda m, raw, limits: parsed.append(raw))
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert parsed == []  # refused before the body was read


def test_json_with_a_charset_is_accepted(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                   headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert r.status_code == 200


# -- sampling bounds, in SamplingParams and in the schema ----------------------------------------------------

def test_the_schema_shows_the_bounds_of_nullable_numbers(server: LiveServer) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=60).json()
    text = json.dumps(schema)
    assert '"ge":' not in text and '"le":' not in text  # pydantic's names, which no JSON Schema client reads
    components = schema["components"]["schemas"]

    def bounds(model: str, field: str) -> tuple[Any, Any]:
        spec = components[model]["properties"][field]
        branch = next(o for o in spec.get("anyOf", [spec]) if o.get("type") in ("integer", "number"))
        return branch.get("minimum", branch.get("exclusiveMinimum")), branch.get("maximum")

    assert bounds("CompletionRequest", "temperature") == (0, 100)
    assert bounds("CompletionRequest", "max_tokens") == (1, 255)
    assert bounds("CompletionRequest", "logprobs") == (0, 5)
    assert bounds("CompletionRequest", "top_k") == (-1, 2**31 - 1)
    assert bounds("CompletionRequest", "repetition_penalty") == (1e-3, 1e3)
    assert bounds("ChatCompletionRequest", "top_logprobs") == (0, 20)
    assert bounds("ChatCompletionRequest", "max_completion_tokens") == (1, 255)
    assert bounds("ChatCompletionRequest", "seed") == (-(2**63), 2**64 - 1)


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("temperature", 100.5), ("top_k", 2**31),
                                          ("repetition_penalty", 1e4)])
def test_sampling_values_beyond_their_bounds_are_refused(server: LiveServer, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_choice": ["a", "b"], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert server.engine.healthy
