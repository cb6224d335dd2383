"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`create_app(engine, config)` builds an app around a running `AsyncEngine`, behind request
accounting and the gate (security.py). Every error leaves as OpenAI error JSON (errors.py); the
OpenAPI schema documents exactly the status codes returned (400 replaces FastAPI's 422).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.engine.async_engine import AsyncEngine
from infer.server.config import ServerConfig
from infer.server.errors import engine_unavailable, install_error_handlers
from infer.server.metrics import CONTENT_TYPE
from infer.server.protocol import ChatCompletionRequest, CompletionRequest
from infer.server.responses import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse,
                                    ErrorResponse, HealthResponse, ModelCard, ModelList)
from infer.server.routes import chat_completion, completion
from infer.server.security import Gatekeeper
from infer.server.serving import ServerState

_ERRORS = {code: {"model": ErrorResponse, "description": text} for code, text in (
    (400, "invalid request (the error names the parameter)"), (401, "missing or wrong API key (with --api-key)"),
    (404, "unknown model"), (413, "request body over --max-request-bytes"),
    (415, "the body is not sent as Content-Type: application/json"),
    (421, "Host header not in --allowed-hosts"), (429, "waiting queue full; see Retry-After"),
    (503, "the engine loop is not running, or the server is shutting down"))}
_STREAM_200 = {"description": "a response, or server-sent events when stream is true",
               "content": {"text/event-stream": {"schema": {"type": "string"}}}}
_STREAM_CHUNKS = {"/v1/completions": CompletionChunk, "/v1/chat/completions": ChatCompletionChunk}
_REQUESTS = (CompletionRequest, ChatCompletionRequest)
_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class RequestAccounting:
    """ASGI middleware (streaming passes untouched): counts requests by endpoint and status (499: the
    client left before a response; 500: the handler raised first), tracks requests in flight."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 499}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if status["code"] == 499:
                status["code"] = 500
            raise
        finally:
            self.state.in_flight -= 1
            path = scope.get("path", "")
            endpoint = path if path in _ROUTES else "other"
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    state = ServerState(engine, config)
    app = FastAPI(title="infer", version="0.1.0",
                  description="OpenAI-compatible server of the infer engine (speculative decoding)")
    app.state.server = state
    install_error_handlers(app)
    _add_generation_routes(app, state)
    _add_info_routes(app, state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    body_limit = state.preparer.limits.max_bytes  # what a request to this model can use
    app.add_middleware(Gatekeeper, config=config, path_limits={path: body_limit for path in _STREAM_CHUNKS})
    app.add_middleware(RequestAccounting, state=state)  # added last: outermost, so it counts the gate's refusals
    return app


def _body(model: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its own body (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses={200: _STREAM_200, **_ERRORS},
              openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Any:
        return await completion(state, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: _STREAM_200, **_ERRORS}, openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        return await chat_completion(state, request)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    created = int(time.time())

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=created, max_model_len=state.max_seq_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses={404: _ERRORS[404]})
    async def model(model: str) -> ModelCard:
        state.check_model(model)
        return card()

    @app.get("/health", response_model=HealthResponse, responses={503: _ERRORS[503], 421: _ERRORS[421]})
    async def health() -> Any:
        if not state.engine.healthy:
            return engine_unavailable(state.engine.error).response()
        return HealthResponse()

    # HEAD: the same status (load balancers probe with it); not in the schema, it has no body
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _sse_event_schema(chunk: str) -> dict[str, Any]:
    """One server-sent event: `data` is a JSON chunk (or error) or the final `[DONE]`."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _document_limits(components: dict[str, Any], state: ServerState) -> None:
    """Write this model's limits into the schema: token ids below the vocabulary size,
    max_tokens below the context length."""
    vocab, context = state.engine.engine.vocab_size, state.max_seq_len

    def bound_ids(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = vocab - 1
            for value in node.values():
                bound_ids(value)
        elif isinstance(node, list):
            for value in node:
                bound_ids(value)

    bound_ids(components["CompletionRequest"]["properties"]["prompt"])
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for field in ("max_tokens", "max_completion_tokens"):
            spec = components[name]["properties"].get(field)
            for option in (spec or {}).get("anyOf", [spec] if spec else []):
                if option.get("type") == "integer":
                    option["maximum"] = context - 1


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with 400 instead of its 422 (validation errors are OpenAI-style 400s)
    and the server-sent events of streaming responses described chunk by chunk."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        _, defs = models_json_schema([(m, "serialization") for m in _STREAM_CHUNKS.values()]
                                     + [(m, "validation") for m in _REQUESTS],
                                     ref_template="#/components/schemas/{model}")
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        for path, model in _STREAM_CHUNKS.items():
            content = schema["paths"][path]["post"]["responses"]["200"]["content"]
            content["text/event-stream"] = {"schema": _sse_event_schema(model.__name__)}
        _document_limits(components, app.state.server)
        app.openapi_schema = schema
    return app.openapi_schema
