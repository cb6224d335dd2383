"""ServerConfig: the HTTP server's own settings (the engine's are `EngineConfig`), validated.

Security defaults: no API key unless given; bound to a loopback address, it answers only loopback
Host headers (against DNS rebinding); bodies are limited; special tokens in user text are text.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
DEFAULT_GRAMMAR_WORKERS = 2
DEFAULT_GRAMMAR_TIMEOUT_S = 30.0
DEFAULT_GRAMMAR_MAX_MEMORY_MIB = 1024
DEFAULT_GRAMMAR_CACHE_MIB = 256
LOOPBACK_NAMES = ("localhost",)  # plus every loopback IP literal (127.0.0.0/8, ::1)
ANY_HOST = "*"


@dataclass
class ServerConfig:
    model_name: str = "infer"
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED  # None: unlimited
    api_key: str | None = None  # requests need `Authorization: Bearer <key>` (not /health)
    public_metrics: bool = False  # /metrics answers without the key too
    allowed_hosts: tuple[str, ...] = (ANY_HOST,)  # Host header names served; "*" = any
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413
    allow_special_tokens: bool = False  # parse special-token strings in user text as control tokens
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # then open requests end with an error
    tokenizer_threads: int = 2  # threads parsing and tokenizing requests off the event loop
    # choices of one request in the engine at once; None: half of max_batch_size (at least 1)
    max_running_choices: int | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers must arrive within this
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open client connections; more are closed at once
    grammar_workers: int = DEFAULT_GRAMMAR_WORKERS  # processes compiling structured outputs' grammars
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S  # one grammar's compile, then 400
    grammar_max_memory_mib: int = DEFAULT_GRAMMAR_MAX_MEMORY_MIB  # memory one compile may take, then 400
    grammar_cache_mib: int = DEFAULT_GRAMMAR_CACHE_MIB  # compiled grammars kept (their memory)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name (--served-model-name) must not be empty")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None (unlimited), got {self.max_queued_requests}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key (--api-key / INFER_API_KEY) is empty: give a key or none")
        if not self.allowed_hosts:
            raise ValueError(f"allowed_hosts is empty: list host names or {ANY_HOST!r} for any")
        self.allowed_hosts = tuple(h.strip().lower() for h in self.allowed_hosts)
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be >= 1, got {self.tokenizer_threads}")
        for name, low in (("grammar_workers", 1), ("grammar_max_memory_mib", 1), ("grammar_cache_mib", 0),
                          ("max_connections", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= {low}, got {getattr(self, name)}")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s (--header-timeout) must be > 0 seconds, got {self.header_timeout_s}")
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s (--grammar-timeout) must be > 0 seconds, got {self.grammar_timeout_s}")
        if self.max_running_choices is not None and self.max_running_choices < 1:
            raise ValueError(f"max_running_choices (--max-running-choices) must be >= 1 or None, "
                             f"got {self.max_running_choices}")

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request's Host header (`name`, `name:port`, `[v6]:port`) is served."""
        if ANY_HOST in self.allowed_hosts:
            return True
        name = host_name(host_header or "")
        if not name:
            return False
        if name in self.allowed_hosts:
            return True
        return "localhost" in self.allowed_hosts and is_loopback(name)


_NAME = re.compile(r"[a-z0-9_.-]+")


def host_name(header: str) -> str:
    """The host part of a Host header, lower case, without port or IPv6 brackets; "" unless it is
    `name`, `name:port` or `[v6]:port` of allowed characters (`localhost:1@evil.example`: "")."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        name, rest = (header[1:end], header[end + 1:]) if end > 0 else ("", "")
        if not re.fullmatch(r"[0-9a-f:.%]+", name):
            return ""
    elif header.count(":") > 1:  # a bare IPv6 literal (no port)
        return header if re.fullmatch(r"[0-9a-f:.]+", header) else ""
    else:
        name, colon, port = header.partition(":")
        rest = colon + port
        if not _NAME.fullmatch(name):
            return ""
    if rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit()):
        return ""
    return name


def is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Loopback names when bound to a loopback address, any host otherwise."""
    return LOOPBACK_NAMES if is_loopback(host_name(bind_host) or bind_host) else (ANY_HOST,)
