"""Tools in a chat prompt: the Llama 3 JSON tool-call text, and tools for templates that do not render them.

A call is `{"name": <function name>, "parameters": <object>}` (`tool_call_text`), several joined
by `CALL_SEPARATOR`. For a template that does not render `tools` / `tool_calls`, `fold_tools`
writes them as text into the system message and the assistant messages. docs/server.md, "Tool calls".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

CALL_SEPARATOR = "; "  # between the calls of one message
TOOLS_INSTRUCTION = ("You can call the functions described below. To call one, reply with nothing but a JSON "
                     'object of the form {"name": <the function\'s name>, "parameters": <an object holding its '
                     "arguments>}.")


def tool_call_text(name: str, arguments: Any) -> str:
    """One call in the Llama 3 JSON format; `arguments` an object or its JSON text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call {name!r} has arguments that are not valid JSON: {exc}") from None
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


@lru_cache(maxsize=16)
def template_support(source: str) -> tuple[bool, bool]:
    """(renders the `tools` variable, renders messages' `tool_calls`) for a chat template."""
    try:
        parsed = ImmutableSandboxedEnvironment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False, False  # (compile_chat_template reports the error)
    return "tools" in jinja2.meta.find_undeclared_variables(parsed), "tool_calls" in source


def fold_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               source: str) -> tuple[list[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]:
    """(messages, tools) to render with `source`: what it does not render is folded into the messages."""
    takes_tools, takes_calls = template_support(source)
    out = list(messages)
    if not takes_calls:
        out = [_calls_as_content(m) for m in out]
    if tools and not takes_tools:
        out = _with_tools_in_system(out, tools)
        tools = None
    return out, tools


def tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The instruction and each tool's definition (JSON), blank-line separated."""
    return "\n\n".join([TOOLS_INSTRUCTION, *(json.dumps(t, ensure_ascii=False, indent=2) for t in tools)])


def _calls_as_content(message: Mapping[str, Any]) -> Mapping[str, Any]:
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    if not calls or not isinstance(calls, Sequence):
        return message
    texts = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        texts.append(tool_call_text(str(function.get("name")), function.get("arguments", {})))
    before = message.get("content")
    text = CALL_SEPARATOR.join(texts)
    content = f"{before}\n\n{text}" if isinstance(before, str) and before.strip() else text
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}


def _with_tools_in_system(messages: list[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
                          ) -> list[Mapping[str, Any]]:
    text = tools_text(tools)
    first = messages[0] if messages else None
    if isinstance(first, Mapping) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
