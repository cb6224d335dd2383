"""Parsing a request body with work bounded by the model, not by the input.

Parsing JSON holds the GIL, so `BodyLimits` bounds a body by what a request to this model can use: its bytes
(`max_seq_len * max_token_chars` characters) and its JSON values (counted by the `,` `[` `{` bytes). `parse_body`
refuses a body over either with 413, unparsed. docs/server.md, "Security and limits".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from infer.server.errors import INVALID_REQUEST, APIError, bad_request, validation_error

M = TypeVar("M", bound=BaseModel)
FIXED_VALUES = 4096  # the parameters besides prompt and messages (stop lists, stop_token_ids, ...)
VALUES_PER_MESSAGE = 4  # {"role": .., "content": ..}: one object, commas between its fields and messages
BYTES_PER_CHAR = 12  # the longest JSON spelling of one character: a \uXXXX\uXXXX surrogate pair
BYTES_PER_VALUE = 32  # a number, key or literal with its separators and some white space


@dataclass(frozen=True)
class BodyLimits:
    max_seq_len: int  # the context: prompt ids or messages a request can carry at most
    structural_per_token: int  # the most `,` `[` `{` bytes one token of the vocabulary spells
    max_token_chars: int  # the most characters one token spells

    @property
    def max_values(self) -> int:
        return self.max_seq_len * (self.structural_per_token + VALUES_PER_MESSAGE) + FIXED_VALUES

    @property
    def max_bytes(self) -> int:
        return BYTES_PER_CHAR * self.max_seq_len * self.max_token_chars + BYTES_PER_VALUE * self.max_values


def structural_count(body: bytes) -> int:
    """An upper bound on the number of JSON values in `body` (see the module docstring)."""
    return body.count(b",") + body.count(b"[") + body.count(b"{")


def parse_body(model: type[M], body: bytes, limits: BodyLimits) -> M:
    """The validated request, or the APIError (413 for too many values, 400 for bad JSON or fields)."""
    if len(body) > limits.max_bytes:
        raise APIError(413, f"the request body has {len(body)} bytes, more than a request to this model can use "
                            f"({limits.max_bytes}, set by its context length {limits.max_seq_len}): send a shorter "
                            "prompt and no unknown fields", INVALID_REQUEST, None, "request_too_large")
    values = structural_count(body)
    if values > limits.max_values:
        raise APIError(413, f"the request body holds up to {values} JSON values, more than a request to this model "
                            f"can use ({limits.max_values}, set by its context length {limits.max_seq_len}): send "
                            "a shorter prompt and no unknown fields", INVALID_REQUEST, None, "request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError and bad UTF-8 are ValueErrors)
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None
