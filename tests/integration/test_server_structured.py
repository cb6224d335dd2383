"""Structured outputs through the server with the official `openai` client: response_format
(json_object, json_schema) on chat and completions, vLLM's guided_* fields, and a 400
naming the field for a bad one, before the request is queued."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from openai import BadRequestError  # noqa: E402

from infer import EngineConfig  # noqa: E402
from infer.engine.loading import DEMO_TARGET  # noqa: E402
from infer.server.launch import LiveServer  # noqa: E402
from helpers.live import openai_api, serving  # noqa: E402

MODEL = "demo"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(EngineConfig(model=str(DEMO_TARGET), device="cpu", max_batch_size=4), MODEL)
    yield from serving(live)


api = openai_api


def test_completions_with_a_json_schema(server):
    r = api(server).completions.create(model=MODEL, prompt="data = ", max_tokens=64, temperature=0,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "rec", "schema": SCHEMA, "strict": True}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_chat_with_a_json_schema(server):
    r = api(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a record"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_and_guided_fields(server):
    client = api(server)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=128, temperature=0.7, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=0.8, seed=2,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, None),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(ab"}, None),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_a_bad_structured_output_is_400(server, extra, param):
    with pytest.raises(BadRequestError) as info:
        api(server).completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    error = info.value.body
    assert error.get("param") == param
    assert error["message"]
