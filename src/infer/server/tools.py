"""A chat request's `tools` and `tool_choice`, read into a `ToolPlan` (`tool_plan`).

`none`: plain text output; `auto` (the default): the output is parsed for Llama 3 JSON calls;
`required` / named: one call, enforced by a JSON schema (`call_schema`). Problems are 400s naming
the field before the request is queued. docs/server.md, "Tool calls".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from infer.sampling import StructuredOutput
from infer.server.errors import APIError, bad_request
from infer.server.guided import structured_output
from infer.server.protocol import ChatCompletionRequest, NamedToolChoice

Mode = Literal["none", "auto", "required", "named"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tool mode, its tools as the chat template takes them, a forced call's schema,
    and whether auto keeps several calls."""

    mode: Mode
    tools: list[dict[str, Any]]  # [{"type": "function", "function": {name, description?, parameters?}}]
    names: frozenset[str]
    structured: StructuredOutput | None = None  # required / named
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def _invalid(message: str, param: str) -> APIError:
    return bad_request(message, param, "invalid_parameter")


def call_schema(name: str, parameters: Mapping[str, Any] | None, at: str = "") -> dict[str, Any]:
    """The JSON schema of one call of function `name`, to sit at JSON pointer `at` of the enforced
    schema (the parameters' local `$ref`s rebased)."""
    rebased = rebase_refs(dict(parameters or NO_PARAMETERS), f"{at}/properties/parameters")
    return {"type": "object", "properties": {"name": {"const": name}, "parameters": rebased},
            "required": ["name", "parameters"], "additionalProperties": False}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values there are data, not schemas


def rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of `schema` whose local JSON-pointer references ("#", "#/...") point to the same
    places once the schema is nested at `pointer` of another one."""
    if isinstance(schema, list):
        return [rebase_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + pointer + value[1:]
        else:
            out[key] = value if key in _DATA_KEYWORDS else rebase_refs(value, pointer)
    return out


def _check_parameters(index: int, name: str, schema: Mapping[str, Any] | None) -> None:
    """An object schema: type "object" (or none), `properties` an object of schemas,
    `required` a list of property names (deeper problems: the grammar compiler's 400)."""
    if schema is None:
        return
    where = f"tools[{index}].function.parameters (function {name!r})"
    kind = schema.get("type", "object")
    if kind != "object":
        raise _invalid(f"{where} must be a JSON schema of an object (type 'object'), got type {kind!r}", "tools")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, (dict, bool)) for v in properties.values()):
        raise _invalid(f"{where}: properties must be an object mapping each argument to its schema", "tools")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _invalid(f"{where}: required must be a list of argument names", "tools")
    unknown = [r for r in required if properties and r not in properties]
    if unknown:
        raise _invalid(f"{where}: required names {unknown}, which are not among its properties "
                       f"{sorted(properties)}", "tools")


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's ToolPlan, None without tools; an APIError 400 naming the field if it cannot be served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise _invalid("tool_choice needs tools: send the functions the model may call in tools, or drop "
                           "tool_choice", "tool_choice")
        return None
    tools: list[dict[str, Any]] = []
    parameters: dict[str, Mapping[str, Any] | None] = {}
    for i, tool in enumerate(body.tools):
        fn = tool.function
        if fn.name in parameters:
            raise _invalid(f"tools[{i}]: a second function named {fn.name!r}: give each tool its own name", "tools")
        _check_parameters(i, fn.name, fn.parameters)
        parameters[fn.name] = fn.parameters
        tools.append({"type": "function", "function": fn.model_dump(exclude_none=True)})
    names = frozenset(parameters)
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto"):
        return ToolPlan(choice or "auto", tools, names, parallel=parallel)  # type: ignore[arg-type]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in parameters:
            raise _invalid(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                           f"({', '.join(sorted(names))})", "tool_choice")
        schema = call_schema(choice.function.name, parameters[choice.function.name])
        mode: Mode = "named"
    else:
        calls = [(name, params) for name, params in parameters.items()]
        schema = call_schema(*calls[0]) if len(calls) == 1 else {
            "anyOf": [call_schema(name, params, f"/anyOf/{i}") for i, (name, params) in enumerate(calls)]}
        mode = "required"
    if structured_output(body) is not None:
        raise _invalid(f"tool_choice {mode} enforces the call's own schema; it cannot be combined with "
                       "response_format or guided_*: drop one of them", "tool_choice")
    return ToolPlan(mode, tools, names, StructuredOutput(json=schema), parallel)
