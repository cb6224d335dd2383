"""Tool calls through the server with the official `openai` client, non-streamed and
streamed, for each tool_choice: required and named calls follow the tools' schemas, auto
parses a call out of the output (forced here by a response_format, the demo model writing
no calls by itself) and leaves other text as content, none leaves the output alone while
the template still gets the tools; tool-call history is accepted; bad tools are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from openai import BadRequestError  # noqa: E402

from infer import EngineConfig  # noqa: E402
from infer.engine.loading import DEMO_TARGET  # noqa: E402
from infer.server.launch import LiveServer  # noqa: E402
from helpers.live import openai_api, serving  # noqa: E402
from infer.server.tools import call_schema  # noqa: E402

MODEL = "demo"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "description": "does nothing"}}]
SCHEMAS = {"get_weather": WEATHER, "noop": {"type": "object"}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer.start(EngineConfig(model=str(DEMO_TARGET), device="cpu", max_batch_size=4), MODEL)
    yield from serving(live)


api = openai_api


def both(live: LiveServer, **request: Any) -> tuple[Any, dict[str, Any]]:
    """(the non-streamed choice, the streamed one assembled: content, calls, finish_reason)."""
    client, fields = api(live), {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **request}
    whole = client.chat.completions.create(**fields).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                assert call["id"] is None or d.id is None, "id and name come with a call's first delta only"
                call["id"], call["name"] = call["id"] or d.id, call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return whole, {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def check_one_call(whole: Any, streamed: dict[str, Any], name: str | None) -> None:
    assert whole.finish_reason == streamed["finish"] == "tool_calls" and whole.message.content is None
    assert len(whole.message.tool_calls) == 1 and len(streamed["calls"]) == 1
    call, s = whole.message.tool_calls[0], streamed["calls"][0]
    assert call.type == "function" and call.id and s["id"]
    assert call.function.name == s["name"] and (name is None or call.function.name == name)
    assert json.loads(call.function.arguments) == json.loads(s["arguments"])  # greedy: the same call
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert streamed["content"] == ""


@pytest.mark.parametrize("choice, name", [("required", None),
                                          ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
                                          ({"type": "function", "function": {"name": "noop"}}, "noop")])
def test_forced_calls_follow_the_tool_schema(server, choice, name):
    whole, streamed = both(server, messages=ASK, tools=TOOLS, tool_choice=choice)
    check_one_call(whole, streamed, name)


def test_auto_parses_a_call_out_of_the_output(server):
    forced = {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema("get_weather", WEATHER)}}
    whole, streamed = both(server, messages=ASK, tools=TOOLS, tool_choice="auto", response_format=forced)
    check_one_call(whole, streamed, "get_weather")


def test_auto_and_none_leave_text_as_content(server):
    whole, streamed = both(server, messages=ASK, tools=TOOLS, extra_body={"guided_choice": ["It is sunny."]})
    assert whole.message.content == streamed["content"] == "It is sunny." and not whole.message.tool_calls
    assert whole.finish_reason == streamed["finish"] == "stop" and streamed["calls"] == []
    client = api(server)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template received the tools


COLOR = {"type": "object", "properties": {"color": {"$ref": "#/$defs/color"}, "shade": {"$ref": "#/$defs/shade"}},
         "required": ["color", "shade"], "additionalProperties": False,
         "$defs": {"color": {"enum": ["red", "blue"]}, "shade": {"$ref": "#/$defs/level"},
                   "level": {"type": "integer", "minimum": 0, "maximum": 3}}}
COLOR_TOOLS = [TOOLS[0], {"type": "function", "function": {"name": "paint", "parameters": COLOR}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "paint"}}, "auto"])
def test_tool_parameters_with_defs_work_under_every_tool_choice(server, choice):
    # nested in the call's schema, the parameters' "#/$defs/..." must still find their $defs
    extra = {}
    if choice == "auto":  # (auto's output is the model's: a schema makes it a call, as the test above)
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "call", "schema": call_schema("paint", COLOR)}}}
    whole = api(server).chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                                messages=[{"role": "user", "content": "paint it"}],
                                                tools=COLOR_TOOLS, tool_choice=choice, **extra).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    call = whole.message.tool_calls[0].function
    schema = {"get_weather": WEATHER, "paint": COLOR}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert choice == "required" or call.name == "paint"


def test_a_tool_call_history_is_accepted(server):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    client = api(server)
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2, temperature=0)
    short = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result are in the prompt


@pytest.mark.parametrize("request_fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wat"}}}}}], "tool_choice": "required"}, None),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "noop", "arguments": "{oops"}}]}]}, "messages"),
])
def test_bad_tools_are_400_before_queueing(server, request_fields, param):
    fields = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **request_fields}
    for stream in (False, True):
        with pytest.raises(BadRequestError) as info:
            api(server).chat.completions.create(stream=stream, **fields)
        assert info.value.body.get("param") == param and info.value.body["message"]
