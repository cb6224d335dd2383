"""Every error the server reports: its status code and OpenAI error JSON, one test each.

400 invalid parameters (named in `param`), a request beyond the context, an empty prompt,
token ids outside the vocabulary, malformed JSON; 404 unknown model or route; 429 with
Retry-After when the waiting queue is full (for a streaming request too: a real 429, not a
200 followed by an error); an engine failure mid-stream (error event, then [DONE]); 503 from
/health and from requests once the engine loop has died (a request it had accepted fails with its own
500, however soon the engine dies); a fault of one request's own work fails that request alone
with a 500 naming it, and the engine goes on.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers.waiting import wait_until
from infer import EngineConfig
from infer.engine.engine import Engine
from infer.server.launch import LiveServer

MODEL = "tiny"
MAX_SEQ_LEN = 64
QUEUE_LIMIT = 2
OK_BODY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=MAX_SEQ_LEN, max_batch_size=4)
    live = LiveServer.start(config, MODEL, max_queued_requests=QUEUE_LIMIT)
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def _failing_engine(ckpt: Path, fail_from: int) -> Engine:
    """An engine whose steps from the `fail_from`-th on raise."""
    engine = Engine(EngineConfig(model=str(ckpt), device="cpu"))
    real_step, calls = engine.runner.step, itertools.count(1)

    def step(*args: Any) -> Any:
        if next(calls) >= fail_from:
            raise RuntimeError("injected runner failure")
        return real_step(*args)

    engine.runner.step = step  # this engine instance only
    return engine


@pytest.fixture
def failing_server(ckpt_a: Path) -> Iterator[LiveServer]:
    """An engine whose 4th step raises: a prefill and two decode steps succeed, then the loop dies."""
    live = LiveServer.start(None, MODEL, engine=_failing_engine(ckpt_a, 4))
    yield live
    live.stop()


@pytest.fixture
def dies_on_accept(ckpt_a: Path) -> Iterator[LiveServer]:
    """An engine whose first step raises, and whose add_request returns only once the engine has
    died: the order in which a fast engine fails a request before its handler runs again."""
    live = LiveServer.start(None, MODEL, engine=_failing_engine(ckpt_a, 1))
    real_add = live.engine.add_request

    async def add_request(*args: Any, **kwargs: Any) -> Any:
        stream = await real_add(*args, **kwargs)
        wait_until(lambda: not live.engine.healthy)
        return stream

    live.engine.add_request = add_request  # type: ignore[method-assign]
    yield live
    live.stop()


def post(live: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
        assert param in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


# -- 400 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("param, value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("max_tokens", 0), ("max_tokens", 2.5), ("repetition_penalty", 0), ("seed", 2**64), ("n", 0), ("n", 129),
    ("stop", [""]), ("stop", 3), ("stop", ["a", "b", "c", "d", "e"]), ("stop", "x" * 257),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("logprobs", 6), ("logprobs", -1), ("echo", "yes"),
    ("stop_token_ids", list(range(257))), ("best_of", 0),
    ("stream", "yes"), ("stream_options", {"include_usage": "yes"}), ("stop_token_ids", [-1]),
    ("prompt", 42), ("model", 7),
])
def test_invalid_parameter_is_400_naming_it(server: LiveServer, param: str, value: Any) -> None:
    for stream in (False, True):
        body = {**OK_BODY, "stream": stream, param: value}
        assert_error(post(server, "/v1/completions", body), 400, param)


@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "hi"}], [{"content": "hi"}], "hi",
                                      [{"role": "user", "content": [{"type": "image", "url": "x"}]}]])
def test_invalid_chat_messages_are_400(server: LiveServer, messages: Any) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages")


def test_prompt_plus_max_tokens_beyond_context_is_400(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {**OK_BODY, "max_tokens": MAX_SEQ_LEN})
    error = assert_error(r, 400, "max_tokens", "context_length_exceeded")
    assert str(MAX_SEQ_LEN) in error["message"]
    long_prompt = list(range(2, 2 + MAX_SEQ_LEN))
    assert_error(post(server, "/v1/completions", {**OK_BODY, "prompt": long_prompt}), 400, "prompt",
                 "context_length_exceeded")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * MAX_SEQ_LEN}], "stream": True}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "messages", "context_length_exceeded")


def test_empty_prompt_is_400(server: LiveServer) -> None:
    for prompt in ("", [], [""], [[]]):
        for stream in (False, True):
            r = post(server, "/v1/completions", {**OK_BODY, "prompt": prompt, "stream": stream})
            assert_error(r, 400, "prompt", "empty_prompt")


def test_token_ids_outside_vocabulary_are_400(server: LiveServer) -> None:
    vocab = server.engine.engine.vocab_size
    for prompt in ([5, vocab], [[vocab + 1000]]):
        r = post(server, "/v1/completions", {**OK_BODY, "prompt": prompt})
        error = assert_error(r, 400, "prompt", "invalid_token_id")
        assert str(vocab - 1) in error["message"]
    assert_error(post(server, "/v1/completions", {**OK_BODY, "prompt": [5, -1]}), 400, "prompt")


def test_several_prompts_in_one_request_are_400(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {**OK_BODY, "prompt": ["a", "b"]})
    error = assert_error(r, 400, "prompt", "invalid_parameter")
    assert "at most 1 item" in error["message"]


def test_malformed_json_is_400(server: LiveServer) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', timeout=60,
                   headers={"content-type": "application/json"})
    error = assert_error(r, 400)
    assert "JSON" in error["message"]


def test_openai_client_sees_typed_errors(server: LiveServer) -> None:
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=4, top_p=2.0)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["code"] == "model_not_found"


# -- 404 ------------------------------------------------------------------------------------


def test_unknown_model_is_404(server: LiveServer) -> None:
    for path, body in (("/v1/completions", OK_BODY),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            r = post(server, path, {**body, "model": "no-such-model", "stream": stream})
            error = assert_error(r, 404, "model", "model_not_found")
            assert MODEL in error["message"]  # says what is served


def test_unknown_route_is_404_error_json(server: LiveServer) -> None:
    assert_error(httpx.get(server.url + "/v1/engines", timeout=60), 404)
    assert_error(httpx.get(server.url + "/v1/completions", timeout=60), 405)


# -- 429 ------------------------------------------------------------------------------------


def test_full_queue_gives_429_with_retry_after(server: LiveServer) -> None:
    """Hold the engine thread so that admitted requests stay queued: max_batch_size +
    QUEUE_LIMIT fit, the next one gets 429."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    holder = threading.Thread(target=server.engine.run_sync, args=(hold,))
    holder.start()
    try:
        assert entered.wait(30)
        capacity = server.state.capacity
        assert capacity == QUEUE_LIMIT + server.engine.engine.resolved.scheduler.max_batch_size
        with ThreadPoolExecutor(capacity) as pool:
            queued = [pool.submit(post, server, "/v1/completions", OK_BODY) for _ in range(capacity)]
            wait_until(lambda: server.state.open_choices == capacity)
            for stream in (True, False):
                with httpx.stream("POST", server.url + "/v1/completions", json={**OK_BODY, "stream": stream},
                                  timeout=60) as r:
                    r.read()
                    error = assert_error(r, 429, None, "queue_full")
                assert int(r.headers["retry-after"]) >= 1
                assert error["type"] == "rate_limit_error"
            release.set()
            assert [f.result().status_code for f in queued] == [200] * capacity
    finally:
        release.set()
        holder.join(60)
    assert post(server, "/v1/completions", OK_BODY).status_code == 200


# -- engine failure -------------------------------------------------------------------------


def sse_payloads(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_engine_error_mid_stream_is_error_event_then_done(failing_server: LiveServer) -> None:
    body = {**OK_BODY, "max_tokens": 20, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", failing_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert [e["object"] for e in events[:-1]] == ["text_completion"] * 3  # tokens of the 3 good steps
    error = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "engine_error" and "log" in error["message"]
    assert "injected" not in error["message"] and "RuntimeError" not in error["message"]  # details: the log only


@pytest.mark.parametrize("stream", [False, True])
def test_engine_that_dies_after_accepting_a_request_fails_it_with_500(dies_on_accept: LiveServer,
                                                                       stream: bool) -> None:
    # accepted, then failed: the request's own error (not the 503 of a request refused at the door)
    body = {**OK_BODY, "stream": stream}
    if not stream:
        assert_error(post(dies_on_accept, "/v1/completions", body), 500, None, "engine_error")
    else:
        with httpx.stream("POST", dies_on_accept.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            payloads = sse_payloads(r)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == "engine_error"
    assert not dies_on_accept.engine.healthy


def test_dead_engine_gives_503(failing_server: LiveServer) -> None:
    # (a server of its own: its 4th step kills the engine inside this request, which fails
    # with the engine; every request after it finds the engine dead)
    r = post(failing_server, "/v1/completions", {**OK_BODY, "max_tokens": 20, "ignore_eos": True})
    assert_error(r, 500, None, "engine_error")
    assert not failing_server.engine.healthy
    error = assert_error(httpx.get(failing_server.url + "/health", timeout=60), 503, None, "engine_unavailable")
    assert "injected" not in error["message"] and "Traceback" not in error["message"]
    for stream in (False, True):
        assert_error(post(failing_server, "/v1/completions", {**OK_BODY, "stream": stream}), 503)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        assert_error(post(failing_server, "/v1/chat/completions", chat), 503)
    assert httpx.get(failing_server.url + "/v1/models", timeout=60).status_code == 200


POISON = "zebra"  # a prompt holding this word faults while its tokens are rendered


@pytest.fixture
def faulting_server(ckpt_a: Path) -> Iterator[LiveServer]:
    """An engine where rendering the tokens of a request whose prompt holds POISON raises
    (inside the request's isolated work: the request fails, the engine goes on)."""
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=MAX_SEQ_LEN))
    poison = engine.tokenizer.encode(" " + POISON, add_special_tokens=False)
    output = engine.runner.output
    real_accept = output.accept

    def accept(request: Any, token_id: int, logprobs: Any = None) -> None:
        ids = request.prompt_token_ids
        if any(ids[i:i + len(poison)] == poison for i in range(len(ids))):
            raise RuntimeError("injected rendering fault")
        real_accept(request, token_id, logprobs)

    output.accept = accept  # type: ignore[method-assign]
    live = LiveServer.start(None, MODEL, engine=engine)
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def test_a_request_s_own_fault_fails_it_alone(faulting_server: LiveServer) -> None:
    body = {**OK_BODY, "max_tokens": 6}
    with ThreadPoolExecutor(3) as pool:
        bad, *good = pool.map(lambda p: post(faulting_server, "/v1/completions", {**body, "prompt": p}),
                              [f"The {POISON} runs", "The quick brown fox", "A slow red fox"])
    assert bad.status_code == 500
    error = bad.json()["error"]
    assert error["code"] == "request_failed" and "injected rendering fault" in error["message"]
    assert all(r.status_code == 200 for r in good)
    assert faulting_server.engine.healthy
    assert post(faulting_server, "/v1/completions", body).status_code == 200  # it goes on serving
