"""The OpenAI-compatible server against the official `openai` client, on a live uvicorn.

Both servers run the tiny checkpoint `ckpt_a`; the speculative one uses the same checkpoint
as its own draft (acceptance ~1, so every round emits several tokens). Greedy outputs must
equal `LLM.generate` / `LLM.chat` for the same prompts, streamed or not; 32 concurrent
streams must all be right; disconnected and timed-out clients must leave every slot and
KV block free; /metrics must expose speculation counters that move.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from infer import LLM, EngineConfig, SamplingParams
from infer_bench.server_load import start_server
from infer.server.launch import LiveServer

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def forward(self, input_ids):",
           "The capital of France is", "Numbers like 1 2 3 appear"]
MAX_TOKENS = 10
MODEL = "tiny"


def engine_config(ckpt: Path, spec: bool, **overrides: Any) -> EngineConfig:
    extra: dict[str, Any] = {}
    if spec:  # the checkpoint drafts for itself
        extra = {"use_speculative_decoding": True, "draft_model": str(ckpt), "spec_length": 4}
    return EngineConfig(model=str(ckpt), device="cpu", max_batch_size=8, **extra, **overrides)


@pytest.fixture(scope="module")
def reference(ckpt_a: Path) -> dict[str, list[Any]]:
    llm = LLM(str(ckpt_a), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate(PROMPTS, greedy)
    chats = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], greedy)
    return {"text": [o.outputs[0].text for o in outs], "tokens": [len(o.outputs[0].token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "chat": [o.outputs[0].text for o in chats], "chat_finish": [o.outputs[0].finish_reason for o in chats]}


@pytest.fixture(scope="module", params=["plain", "spec"])
def server(request: pytest.FixtureRequest, ckpt_a: Path) -> Iterator[LiveServer]:
    live = LiveServer.start(engine_config(ckpt_a, request.param == "spec"), MODEL, max_queued_requests=512)
    live.kind = request.param  # type: ignore[attr-defined]
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


@pytest.fixture(scope="module")
def plain_server(ckpt_a: Path) -> Iterator[LiveServer]:
    live = LiveServer.start(engine_config(ckpt_a, spec=False), MODEL, max_queued_requests=512)
    yield live
    live.stop()


def client(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric_samples(live: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(live.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# -- parity with LLM ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_equal_llm_generate(server: LiveServer, reference: dict, stream: bool) -> None:
    api = client(server)
    for i, prompt in enumerate(PROMPTS):
        if stream:
            chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
            texts = [c.choices[0].text for c in chunks if c.choices]
            text, finish, usage = "".join(texts), chunks[-2].choices[0].finish_reason, chunks[-1].usage
            assert len(texts) == usage.completion_tokens  # one chunk per token, none lost or merged
        else:
            r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == reference["text"][i]
        assert finish == reference["finish"][i]
        assert usage.completion_tokens == reference["tokens"][i]
        assert usage.prompt_tokens == reference["prompt_tokens"][i]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_equals_llm_chat(server: LiveServer, reference: dict, stream: bool) -> None:
    api = client(server)
    for i, prompt in enumerate(PROMPTS):
        messages = [{"role": "user", "content": prompt}]
        if stream:
            chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            assert r.choices[0].message.role == "assistant"
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == reference["chat"][i]
        assert finish == reference["chat_finish"][i]


def test_prompt_as_token_ids_equals_text_prompt(server: LiveServer, ckpt_a: Path, reference: dict) -> None:
    ids = LLM(str(ckpt_a), device="cpu").tokenizer.encode(PROMPTS[0])
    r = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference["text"][0]
    assert r.usage.prompt_tokens == len(ids)


def test_speculative_stats_in_extension_field(server: LiveServer) -> None:
    api = client(server)
    r = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True))
    final = chunks[-1].model_extra["speculative_decoding"]
    whole = r.model_extra["speculative_decoding"]
    if server.kind == "plain":  # type: ignore[attr-defined]
        assert whole is None and final is None
        return
    for stats in (whole, final):  # the target drafting for itself: nearly everything is accepted
        assert 0.5 < stats["acceptance_rate"] <= 1.0
        assert 1.0 < stats["mean_accepted_length"] <= 5.0
    assert all(c.model_extra["speculative_decoding"] is None for c in chunks[:-1])


# -- concurrency and cancellation -----------------------------------------------------------


async def _stream_text(api: AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
    stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=True)
    parts, finish = [], None
    async for chunk in stream:
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_32_concurrent_streams_all_correct(server: LiveServer, reference: dict) -> None:
    async def run() -> list[tuple[str, str | None]]:
        api = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(_stream_text(api, PROMPTS[i % len(PROMPTS)]) for i in range(32)))
        finally:
            await api.close()

    results = asyncio.run(run())
    for i, (text, finish) in enumerate(results):
        assert text == reference["text"][i % len(PROMPTS)]
        assert finish == reference["finish"][i % len(PROMPTS)]


def test_closed_stream_aborts_its_request(plain_server: LiveServer) -> None:
    before = metric_samples(plain_server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", plain_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"text_completion"' in first
    plain_server.settle()  # returns only once the engine holds no request: the abort happened
    after = metric_samples(plain_server)
    assert sample(after, "infer_request_finish_total", reason="abort") == \
        sample(before, "infer_request_finish_total", reason="abort") + 1
    generated = sample(after, "infer_generation_tokens_total") - sample(before, "infer_generation_tokens_total")
    assert generated < 400
    assert plain_server.leak_report() == []


def test_200_timed_out_requests_free_everything(plain_server: LiveServer, reference: dict) -> None:
    """Every request is sent in full (long connect/pool timeouts); the 0.5 s read timeout then
    cancels those whose tokens do not arrive in time: all non-streamed ones (480 tokens each)
    and the streamed ones still waiting for a slot."""
    async def fire(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 480, "ignore_eos": True,
                "stream": i % 4 == 0}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass
            return "completed"
        except httpx.ReadTimeout:
            return "timeout"

    async def run() -> list[str]:
        timeout = httpx.Timeout(60.0, read=0.5)
        async with httpx.AsyncClient(base_url=plain_server.url, timeout=timeout,
                                     limits=httpx.Limits(max_connections=256)) as c:
            return await asyncio.gather(*(fire(c, i) for i in range(200)))

    before = sample(metric_samples(plain_server), "infer_request_finish_total", reason="abort")
    outcomes = asyncio.run(run())
    assert outcomes.count("timeout") + outcomes.count("completed") == 200
    assert outcomes.count("timeout") > 0
    plain_server.settle()
    assert plain_server.leak_report() == []
    samples = metric_samples(plain_server)
    assert sample(samples, "infer_request_finish_total", reason="abort") > before
    assert sample(samples, "infer_num_requests_running") == 0
    assert sample(samples, "infer_num_requests_waiting") == 0
    assert sample(samples, "infer_kv_cache_usage_ratio") == 0
    r = client(plain_server).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference["text"][2]


# -- info endpoints and metrics -------------------------------------------------------------


def test_models_and_health(server: LiveServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == server.state.max_seq_len
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics_speculation_counters_move(server: LiveServer) -> None:
    names = ("infer_spec_decode_drafts_total", "infer_spec_decode_draft_tokens_total",
             "infer_spec_decode_accepted_tokens_total")
    before = metric_samples(server)
    client(server).completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0)
    after = metric_samples(server)
    for name in names:
        assert (name, ()) in after  # exported whether or not speculation is on
    moved = [sample(after, n) - sample(before, n) for n in names]
    first = sample(after, "infer_spec_decode_accepted_per_position_total", position="0") - \
        sample(before, "infer_spec_decode_accepted_per_position_total", position="0")
    if server.kind == "plain":  # type: ignore[attr-defined]
        assert moved == [0, 0, 0] and first == 0
    else:
        assert all(m > 0 for m in moved)
        assert moved[2] <= moved[1]  # accepted <= drafted
        assert first > 0
    assert sample(after, "infer_time_to_first_token_seconds_count") == \
        sample(before, "infer_time_to_first_token_seconds_count") + 1
    assert sample(after, "infer_requests_total", endpoint="/v1/completions", status="200") == \
        sample(before, "infer_requests_total", endpoint="/v1/completions", status="200") + 1
    assert sample(after, "infer_inter_token_latency_seconds_count") > \
        sample(before, "infer_inter_token_latency_seconds_count")


# -- command line ---------------------------------------------------------------------------


def test_infer_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from infer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--served-model-name", "--max-queued-requests", "--model", "--draft-model",
                 "--speculative-decoding", "--spec-length", "--speculative-method", "--max-batch-size"):
        assert flag in out


def test_python_m_infer_server_serves(ckpt_a: Path) -> None:
    proc, url = start_server(["--model", str(ckpt_a), "--device", "cpu", "--served-model-name", "cli-model",
                              "--max-queued-requests", "4"], 120, capture_output=True)
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["cli-model"]
        r = httpx.post(url + "/v1/completions", json={"model": "cli-model", "prompt": "Hi", "max_tokens": 3},
                       timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode()
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Traceback" not in output
