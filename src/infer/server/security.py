"""The gate in front of the app (plain ASGI, so streaming passes through untouched).

`Gatekeeper` checks in order: the Host header against `allowed_hosts` (421), the API key but on `OPEN_PATHS` (401),
a generation POST's Content-Type (415: browsers send other types cross-origin without a preflight), the body's size
(413; the body read here is replayed to the app). docs/server.md, "Security and limits".
"""

from __future__ import annotations

import hmac
import sys
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.server.config import ServerConfig
from infer.server.errors import INVALID_REQUEST, APIError

OPEN_PATHS = frozenset({"/health"})
JSON = "application/json"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Gatekeeper:
    def __init__(self, app: ASGIApp, config: ServerConfig, path_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.config = config
        self.open_paths = OPEN_PATHS | ({"/metrics"} if config.public_metrics else set())
        self.path_limits = dict(path_limits or {})

    def body_limit(self, scope: Scope) -> int:
        return min(self.config.max_request_bytes, self.path_limits.get(scope.get("path", ""), sys.maxsize))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            body = await self._read_body(scope, receive)
            if isinstance(body, APIError):
                refusal = body
            else:
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        config = self.config
        host = _header(scope, b"host")
        if not config.host_allowed(host):
            return APIError(421, "this server does not answer requests for that Host header; allow the name "
                                 "with --allowed-hosts if it should", INVALID_REQUEST, None, "host_not_allowed")
        if config.api_key is not None and scope.get("path", "") not in self.open_paths:
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
                return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                     "with the key the server was started with", INVALID_REQUEST, None,
                                "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST" and scope.get("path", "") in self.path_limits:
            media_type = (_header(scope, b"content-type") or "").partition(";")[0].strip().lower()
            if media_type != JSON:
                shown = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
                return APIError(415, f"the request body must be JSON sent with 'Content-Type: {JSON}', got "
                                     f"{shown}", INVALID_REQUEST, None, "unsupported_media_type")
        length = _header(scope, b"content-length")
        limit = self.body_limit(scope)
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit, limit < config.max_request_bytes)
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError:
        """The whole request body (at most max_request_bytes), or the 413 to send instead."""
        if scope.get("method") in ("GET", "HEAD"):
            return b""
        parts: list[bytes] = []
        size = 0
        limit = self.body_limit(scope)
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _too_large(limit, limit < self.config.max_request_bytes)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _too_large(limit: int, by_model: bool) -> APIError:
    why = ("more than a request to this model can use (set by its context length): send a shorter prompt and no "
           "unknown fields") if by_model else "send a shorter prompt (or start the server with a larger " \
        "--max-request-bytes)"
    # Connection: close, so that the server does not read (and throw away) the rest of the body
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes, {why}",
                    INVALID_REQUEST, None, "request_too_large", {"Connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the buffered body once, then the client's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
