"""The request fields that ask for a structured output (OpenAI's `response_format`, vLLM's
`guided_*`), read into a `StructuredOutput`. At most one may ask; a malformed one is a 400
naming the field."""

from __future__ import annotations

from typing import Any

from infer.sampling import StructuredOutput
from infer.server.errors import APIError, bad_request


def _invalid(message: str, param: str) -> APIError:
    return bad_request(message, param, "invalid_parameter")


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _invalid("response_format must be an object with a type: text, json_object or json_schema",
                       "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _invalid("response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _invalid("response_format json_schema.schema must be a JSON schema object", "response_format")
        return _spec("response_format", json=schema)
    raise _invalid(f"response_format type {kind!r} is not one of text, json_object, json_schema", "response_format")


def _spec(param: str, **field: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**field)
    except ValueError as exc:
        raise _invalid(f"{param}: {exc}", param) from exc


def structured_output(req: Any) -> StructuredOutput | None:
    """The structured output a request asks for, or None (free text)."""
    found: list[tuple[str, StructuredOutput]] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec(name, **{key: value})))
    if len(found) > 1:
        raise _invalid(f"ask for one structured output, got {', '.join(n for n, _ in found)}", found[1][0])
    return found[0][1] if found else None
