"""Tool calls without a model: the Llama 3 JSON parser, the streaming reader (its deltas join
to what the whole text gives), the request's ToolPlan (schemas, 400s), and tools reaching
chat templates with and without tool support."""

from __future__ import annotations

import json
from typing import Any

import pytest

from infer.server.errors import APIError
from infer.server.protocol import ChatCompletionRequest
from infer.server.tool_calls import CallReader, ParsedCall, parse_tool_calls
from infer.server.tools import call_schema, tool_plan
from infer.tokenization.chat import LLAMA3_CHAT_TEMPLATE, render_chat_template
from infer.tokenization.tool_prompt import TOOLS_INSTRUCTION, template_support

NAMES = {"get_weather", "noop"}
SPECIALS = {"bos_token": "<|begin_of_text|>"}


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "noop", "parameters": {}}', [("noop", {})]),
    ('  <|python_tag|> {"name":"noop","arguments":{"a":[1,{"b":"}"}]}}\n', [("noop", {"a": [1, {"b": "}"}]})]),
    ('{"name": "noop", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     [("noop", {}), ("get_weather", {"city": "Oslo"})]),
])
def test_llama3_json_calls_parse(text: str, calls: list[tuple[str, dict]]) -> None:
    got = parse_tool_calls(text, NAMES)
    assert got is not None and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "",
    '{"name": "get_weather", "parameters": {"city": "Paris"}',  # unclosed
    '{"name": "get_weather", "parameters": "Paris"}',  # arguments not an object
    '{"name": "unknown_fn", "parameters": {}}',  # not among the tools
    '{"name": "noop", "parameters": {}, "extra": 1}',
    '{"city": "Paris"}',  # JSON, but not a call
    '{"name": "noop", "parameters": {}} and then prose',
    '{"name": "noop", "parameters": {}};',
    '[{"name": "noop", "parameters": {}}]',
])
def test_anything_else_is_not_a_call(text: str) -> None:
    assert parse_tool_calls(text, NAMES) is None


def _read(reader: CallReader, pieces: list[str], complete: bool = True) -> tuple[str, list[Any]]:
    content, deltas = "", []
    for piece in pieces:
        c, d = reader.feed(piece)
        content, deltas = content + c, deltas + d
    c, d = reader.finish(complete)
    return content + c, deltas + d


def _joined(deltas: list[Any]) -> dict[int, tuple[str | None, str]]:
    out: dict[int, tuple[str | None, str]] = {}
    for d in deltas:
        name, args = out.get(d.index, (None, ""))
        out[d.index] = (name or d.name, args + d.arguments)
    return out


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Par}is", "days": {"n": 2}}}',
    '{"name":"noop","parameters":{}}',
    '{"name": "noop", "parameters": {"x": 1} }',
])
def test_a_forced_call_streams_its_arguments(text: str) -> None:
    streamed = CallReader(forced=True, names=NAMES)
    content, deltas = _read(streamed, list(text))  # one character a delta
    whole = CallReader(forced=True, names=NAMES)
    _read(whole, [text])
    expected = parse_tool_calls(text, NAMES)
    assert expected is not None and content == ""
    assert deltas[0].id is not None and deltas[0].name == expected[0].name and deltas[0].arguments == ""
    assert all(d.id is None for d in deltas[1:]) and len(deltas) >= 3  # fragments as they come
    name, arguments = _joined(deltas)[0]
    assert (name, json.loads(arguments)) == (expected[0].name, json.loads(expected[0].arguments))
    assert whole.calls == streamed.calls == [ParsedCall(name, arguments)]


def test_a_forced_call_cut_short_keeps_what_was_generated() -> None:
    reader = CallReader(forced=True, names=NAMES)
    content, deltas = _read(reader, ['{"name": "get_weather", "parameters": {"ci', 'ty": "Pa'], complete=False)
    assert content == "" and _joined(deltas)[0] == ("get_weather", '{"city": "Pa')
    early = CallReader(forced=True, names=NAMES)
    assert _read(early, ['{"name": "get_w'], complete=False) == ('{"name": "get_w', [])
    assert not early.called and early.content == '{"name": "get_w'


def test_auto_streams_prose_and_holds_back_a_call() -> None:
    prose = CallReader(forced=False, names=NAMES)
    assert prose.feed("  It is")[0] == "  It is" and prose.feed(" sunny.")[0] == " sunny."
    assert prose.finish(True) == ("", []) and prose.content == "  It is sunny." and not prose.called
    call = CallReader(forced=False, names=NAMES)
    text = '{"name": "noop", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert all(call.feed(ch) == ("", []) for ch in text)
    content, deltas = call.finish(True)
    assert content == "" and [(d.index, d.name, json.loads(d.arguments)) for d in deltas] == [
        (0, "noop", {}), (1, "get_weather", {"city": "Oslo"})]
    assert all(d.id for d in deltas) and call.called
    single = CallReader(forced=False, names=NAMES, parallel=False)
    assert len(_read(single, [text])[1]) == 1
    json_prose = CallReader(forced=False, names=NAMES)
    assert _read(json_prose, ['{"city":', ' "Paris"}']) == ('{"city": "Paris"}', [])


def _request(**fields: Any) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "noop"}}]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, **fields})


def test_tool_plans() -> None:
    assert tool_plan(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})) is None
    auto = tool_plan(_request())
    assert auto is not None and auto.mode == "auto" and auto.structured is None and auto.names == NAMES
    assert auto.tools[1] == {"type": "function", "function": {"name": "noop"}}
    none = tool_plan(_request(tool_choice="none"))
    assert none is not None and none.mode == "none" and len(none.tools) == 2  # the template still gets them
    named = tool_plan(_request(tool_choice={"type": "function", "function": {"name": "noop"}}))
    assert named is not None and named.forced and json.loads(named.structured.json) == call_schema("noop", None)
    required = tool_plan(_request(tool_choice="required"))
    assert required is not None and required.forced
    assert [s["properties"]["name"] for s in json.loads(required.structured.json)["anyOf"]] == [
        {"const": "get_weather"}, {"const": "noop"}]


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "second function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {}}, "required": ["b"]}}}]}, "tools", "['b']"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs tools"),
])
def test_bad_tools_are_400s_naming_the_field(fields: dict, param: str, words: str) -> None:
    with pytest.raises(APIError) as info:
        tool_plan(_request(**fields))
    assert info.value.status_code == 400 and info.value.param == param and words in info.value.message


def test_templates_receive_tools_or_get_them_as_text() -> None:
    tools = [{"type": "function", "function": {"name": "noop", "description": "does nothing"}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "noop", "arguments": {"x": 1}}}]},
               {"role": "tool", "content": "done", "tool_call_id": "c1"}]
    assert template_support(LLAMA3_CHAT_TEMPLATE) == (False, False)
    text = render_chat_template(LLAMA3_CHAT_TEMPLATE, history, add_generation_prompt=True,
                                special_tokens=SPECIALS, tools=tools)
    system, user, assistant, tool = text.split("<|eot_id|>")[:4]
    assert system.startswith("<|begin_of_text|><|start_header_id|>system") and TOOLS_INSTRUCTION in system
    assert '"description": "does nothing"' in system
    assert assistant.endswith('{"name": "noop", "parameters": {"x": 1}}')
    assert tool.endswith("<|start_header_id|>ipython<|end_header_id|>\n\ndone")
    aware = ("{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}"
             "{% for c in m.tool_calls or [] %}C:{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")
    assert template_support(aware) == (True, True)
    assert render_chat_template(aware, history, add_generation_prompt=False, special_tokens=SPECIALS,
                                tools=tools) == 'T:noop;C:{"x": 1};'
