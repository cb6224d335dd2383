"""OpenAI-style errors for the server: `{"error": {"message", "type", "param", "code"}}`.

`install_error_handlers` turns `APIError` and FastAPI's own errors into that JSON shape.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"
log = logging.getLogger("infer.server")


class APIError(Exception):
    """An error the server reports to the client with a status code and OpenAI error JSON."""

    def __init__(self, status_code: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def engine_unavailable(detail: str | None) -> APIError:
    """503 for a dead engine loop; `detail` (its traceback, logged by AsyncEngine) is not shown."""
    why = "has stopped after an internal error" if detail else "is not running"
    return APIError(503, f"the inference engine {why}: restart the server (its log has the details)",
                    UNAVAILABLE, None, "engine_unavailable")


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    """The top-level body field an error is about: ('body', 'temperature') -> 'temperature'."""
    parts = [p for p in loc if p != "body"]
    return str(parts[0]) if parts and isinstance(parts[0], str) else None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _loc_text(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            text += f".{part}" if text else part
    return text


def _validation_message(errors: list[dict[str, Any]]) -> str:
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": ")
    params = {_validation_param(tuple(e.get("loc", ()))) for e in errors}
    if len(errors) > 1 and len(params) == 1:  # one field, several accepted forms (a union)
        forms = list(dict.fromkeys(f"{_loc_text(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors))
        return f"{params.pop()} matches none of its accepted forms: " + "; ".join(forms[:6])
    where = _loc_text(tuple(first.get("loc", ()))) or "request body"
    extra = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{extra}"


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic's errors: the first one's field as `param`; a body that is not
    JSON has code `invalid_json`, anything else `invalid_parameter`."""
    errors = errors or [{"loc": (), "msg": "invalid request"}]
    if errors[0].get("type") == "json_invalid":
        return bad_request(_validation_message(errors), None, "invalid_json")
    param = _validation_param(tuple(errors[0].get("loc", ())))
    return bad_request(_validation_message(errors), param, "invalid_parameter")


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(list(exc.errors())).response()


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
    return APIError(exc.status_code, str(exc.detail), kind, None, code,
                    dict(exc.headers) if exc.headers else None).response()


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error while handling a request", exc_info=exc)
    return APIError(500, "internal server error: the server log has the details", SERVER_ERROR, None,
                    "internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
