"""The `speculation` extra body field (false, or a K) through the server and the official
`openai` client: requests with speculation off, at K = 2 and at the server's K give plain
greedy decoding's text, together or apart; only speculating requests report speculation
statistics; bad values and a K above the server's are 400s naming the field; the OpenAPI
schema shows it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers.live import openai_api, post, serving
from infer import EngineConfig, LLM, SamplingParams
from infer.server.launch import LiveServer

MODEL = "tiny"
K = 3  # the server's spec_length
PROMPT = "the cat sat on the mat"
TOKENS = 12
SPECS: tuple[bool | int | None, ...] = (False, 2, None)


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=4, use_speculative_decoding=True,
                          draft_model=str(ckpt_a), spec_length=K)
    yield from serving(LiveServer.start(config, MODEL))


@pytest.fixture(scope="module")
def plain_text(ckpt_a: Path) -> dict[str, str]:
    """Plain greedy decoding's completion of PROMPT and of the chat of PROMPT."""
    llm = LLM(str(ckpt_a), device="cpu", max_seq_len=256)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    out = {"completion": llm.generate(PROMPT, params)[0].outputs[0].text,
           "chat": llm.chat([{"role": "user", "content": PROMPT}], params)[0].outputs[0].text}
    assert llm.engine.leak_report() == []
    return out


def _extra(spec: bool | int | None) -> dict[str, Any]:
    return {"ignore_eos": True, **({} if spec is None else {"speculation": spec})}


def _complete(server: LiveServer, spec: bool | int | None) -> Any:
    return openai_api(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                 extra_body=_extra(spec))


def test_completions_off_at_k_and_by_default_give_plain_decodings_text(server: LiveServer,
                                                                      plain_text: dict[str, str]) -> None:
    with ThreadPoolExecutor(len(SPECS)) as pool:  # (in flight together: they share the engine's batches)
        together = list(pool.map(lambda s: _complete(server, s), SPECS))
    apart = [_complete(server, s) for s in SPECS]
    for spec, r in zip(SPECS * 2, together + apart, strict=True):
        assert r.choices[0].text == plain_text["completion"], spec
        stats = r.model_extra["speculative_decoding"]
        assert (stats is None) == (spec is False), spec


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("spec", [False, 2])
def test_chat_takes_the_field(server: LiveServer, plain_text: dict[str, str], spec: bool | int,
                              stream: bool) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS,
                                  temperature=0, extra_body=_extra(spec))
    api = openai_api(server)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = api.chat.completions.create(**kwargs).choices[0].message.content
    assert text == plain_text["chat"]


@pytest.mark.parametrize("value, words", [
    (True, "send false"), (0, "greater than or equal to 1"), (-1, "greater than or equal to 1"), (2.5, "integer"), ("2", "integer"),
    (K + 1, f"spec_length {K}"), (100, f"spec_length {K}"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_values_are_400_naming_the_field(server: LiveServer, route: str, value: Any, words: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "speculation": value}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user",
                                                                                      "content": PROMPT}]})
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "speculation" and words in error["message"], error


def test_the_openai_client_sees_the_400(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        _complete(server, K + 1)
    assert bad.value.body["param"] == "speculation"


def test_the_openapi_schema_shows_the_field(server: LiveServer) -> None:
    schemas = httpx.get(server.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        field = schemas[name]["properties"]["speculation"]
        assert {"const": False, "type": "boolean"} in field["anyOf"], field
        assert {"minimum": 1, "type": "integer"} in field["anyOf"], field
        assert "spec_length" in field["description"]
