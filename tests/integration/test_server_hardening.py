"""A server that one client cannot stall: bounded preparation, parsing off the event loop,
shutdown that answers requests still being prepared, exact admission, fair many-choice
requests, and the smaller protocol points (Host parsing, HEAD /health, /v1/models/{id},
stop_token_ids, JSON errors, the schema's conditional fields, metrics).

"Does not stall" is shown with synchronisation: a tokenizer (or the body parser) is held on
a threading.Event while /health and another request are answered.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.waiting import Gate, held, wait_until
from infer import EngineConfig
from infer.server import prepare as prepare_module
from infer.server.launch import LiveServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=2, max_seq_len=512)
    live = LiveServer.start(config, MODEL, max_queued_requests=3)
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def post(server: LiveServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


# -- 1. bounded preparation --------------------------------------------------------------------

def test_a_text_longer_than_the_context_can_spell_is_refused_untokenized(server: LiveServer,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    preparer = server.state.preparer
    tokenizer = server.engine.engine.tokenizer
    calls: list[str] = []
    for name in ("encode", "encode_chat"):
        real = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name),
                                                                                     _real(*a, **k))[1])
    most = preparer.max_seq_len * preparer.max_token_chars
    assert preparer.max_token_chars >= max(len(tokenizer.decode([i])) for i in range(tokenizer.vocab_size))
    text = "def f(x):\n    return x\n" * (most // 20 + 1)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    assert chat.status_code == 400
    assert chat.json()["error"]["param"] == "messages"
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    completion = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert completion.status_code == 400 and completion.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []  # neither text was tokenized
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2}).status_code == 200
    assert calls == ["encode_chat"]


# -- 2. parsing cannot stall other clients -----------------------------------------------------

def test_body_with_more_values_than_a_request_can_use_is_413_unparsed(server: LiveServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.server import body as body_module
    parsed: list[int] = []
    real_loads = body_module.json.loads
    monkeypatch.setattr(body_module, "json", type("J", (), {"loads": staticmethod(
        lambda raw: (parsed.append(len(raw)), real_loads(raw))[1])}))
    limits = server.state.preparer.limits
    limit = limits.max_values
    assert limits.max_bytes < 8 * 2**20  # (the demo-sized context bounds bodies below the server's own limit)
    for body in ({"prompt": [1] * (limit + 1)}, {"prompt": "x", "unknown": [0] * (limit + 1)},
                 {"messages": [{"role": "user", "content": "x"}], "logit_bias": {str(i): 1 for i in range(limit)}},
                 {"prompt": "x", "unknown": "y" * limits.max_bytes}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = post(server, path, body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert parsed == []
    assert post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
    assert len(parsed) == 1


def test_health_and_other_requests_answer_while_a_body_is_parsed_and_a_prompt_tokenized(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    parse_gate, tokenize_gate = Gate(), Gate()
    monkeypatch.setattr(prepare_module, "parse_body",
                        held(prepare_module.parse_body, parse_gate, lambda _m, raw, _l: b"HOLD-PARSE" in raw))
    tokenizer = server.engine.engine.tokenizer
    monkeypatch.setattr(tokenizer, "encode", held(tokenizer.encode, tokenize_gate,
                                                  lambda text, *a, **k: "HOLD-TOKENIZE" in text))
    with ThreadPoolExecutor(2) as pool:
        parsing = pool.submit(post, server, "/v1/completions", {"prompt": "HOLD-PARSE", "max_tokens": 1})
        tokenizing = pool.submit(post, server, "/v1/completions", {"prompt": "HOLD-TOKENIZE", "max_tokens": 1})
        try:
            assert parse_gate.entered.wait(60) and tokenize_gate.entered.wait(60)
            # both preparation threads are held: the event loop still answers
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            assert httpx.get(server.url + "/v1/models", timeout=60).status_code == 200
            assert not parsing.done() and not tokenizing.done()
        finally:
            parse_gate.release()
            tokenize_gate.release()
        assert parsing.result().status_code == 200 and tokenizing.result().status_code == 200


# -- 3. shutdown answers requests being prepared -------------------------------------------------

def test_shutdown_answers_a_request_being_prepared_with_503_json(ckpt_a: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    live = LiveServer.start(EngineConfig(model=str(ckpt_a), device="cpu"), MODEL, shutdown_timeout_s=0)
    gate = Gate()
    tokenizer = live.engine.engine.tokenizer
    monkeypatch.setattr(tokenizer, "encode", held(tokenizer.encode, gate, lambda text, *a, **k: text == "HOLD"))
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, live, "/v1/completions", {"prompt": "HOLD", "max_tokens": 1})
            assert gate.entered.wait(60)
            stopper = threading.Thread(target=live.thread.stop)
            stopper.start()
            r = pending.result()
            gate.release()
            stopper.join(60)
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "server_shutdown"
        assert not live.thread.thread.is_alive()
    finally:
        gate.release()
        live.state.close()
        live.engine.shutdown()


# -- 4, 5. admission: 400 for what never fits, an exact cap --------------------------------------

def test_n_beyond_the_servers_capacity_is_400_not_429(server: LiveServer) -> None:
    capacity = server.state.capacity
    assert capacity == 2 + 3  # max_batch_size + max_queued_requests
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": capacity + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "Retry-After" not in r.headers
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": capacity}).status_code == 200


def test_the_cap_admits_exactly_capacity_choices(server: LiveServer) -> None:
    capacity = server.state.capacity
    for _ in range(2):  # the same count every time
        gate = Gate()
        holder = threading.Thread(target=server.engine.run_sync, args=(gate.wait,))
        holder.start()
        try:
            assert gate.entered.wait(30)
            with ThreadPoolExecutor(capacity + 4) as pool:
                sent = [pool.submit(post, server, "/v1/completions", {"prompt": f"r{i}", "max_tokens": 2})
                        for i in range(capacity + 4)]
                wait_until(lambda: sum(f.done() for f in sent) == 4, 60)
                assert sorted(f.result().status_code for f in sent if f.done()) == [429] * 4
                assert server.state.open_choices == capacity
                gate.release()
                assert sorted(f.result().status_code for f in sent) == [200] * capacity + [429] * 4
        finally:
            gate.release()
            holder.join(60)


# -- 6. one request with many choices cannot starve the rest -------------------------------------

def test_a_small_request_runs_beside_a_many_choice_request(server: LiveServer) -> None:
    assert server.state.running_limit == 1  # max_batch_size 2: one slot stays free for others
    big = {"prompt": "big", "max_tokens": 400, "ignore_eos": True, "n": 3, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=big, timeout=300) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # choice 0 is generating
        small = post(server, "/v1/completions", {"prompt": "small", "max_tokens": 2, "ignore_eos": True})
        assert small.status_code == 200
        unstarted = server.state.reserved  # the big request's choices that have not started
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                events.append("big choice finished")
    assert unstarted == 2  # the small request did not wait for any choice of the big one
    assert events == ["big choice finished"] * 3


# -- 7. smaller points ---------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["localhost:8001@attacker.example", "localhost:abc", "localhost:", "a b"])
def test_malformed_host_headers_are_refused(server: LiveServer, host: str) -> None:
    r = httpx.get(server.url + "/health", headers={"Host": host}, timeout=60)
    assert r.status_code == 421


def test_head_health_and_get_model_by_id(server: LiveServer) -> None:
    assert httpx.head(server.url + "/health", timeout=60).status_code == 200
    card = httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=60)
    assert card.status_code == 200 and card.json()["id"] == MODEL
    missing = httpx.get(server.url + "/v1/models/other", timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_out_of_vocabulary_stop_token_ids_and_bad_json_are_400_with_codes(server: LiveServer) -> None:
    vocab = server.engine.engine.vocab_size
    r = post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [vocab]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    bad = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', timeout=60,
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_chat_context_error_names_messages(server: LiveServer) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 512})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_schema_says_what_the_server_refuses(server: LiveServer) -> None:
    schemas = httpx.get(server.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    suffix = schemas["CompletionRequest"]["properties"]["suffix"]
    assert {"const": "", "type": "string"} in suffix["anyOf"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["then"]["properties"]["logprobs"] == {"const": True}
    for suffix in ({}, "end"):  # refused by the schema itself
        r = post(server, "/v1/completions", {"prompt": "hi", "suffix": suffix})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "suffix": ""}).status_code == 200


def test_prompt_tokens_are_counted_once_per_request(server: LiveServer) -> None:
    def counted() -> float:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("infer_prompt_tokens_total ")))

    before = counted()
    r = post(server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1, "n": 3})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
    assert counted() - before == 4
