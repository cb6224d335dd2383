"""`python -m infer.server` / `infer serve`: the OpenAI-compatible HTTP server.

    python -m infer.server                                  # the bundled demo pair
    python -m infer.server --model ./my-llama --speculative-decoding --draft-model ./my-draft \\
        --port 8000 --served-model-name llama --api-key "$KEY"

Engine flags are as for `infer generate`; flags, model paths and the port are checked before loading.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

from infer import DISTRIBUTION
from infer.engine.args import add_engine_args, dash_flags, engine_config_from_args
from infer.server.config import (DEFAULT_GRAMMAR_CACHE_MIB, DEFAULT_GRAMMAR_MAX_MEMORY_MIB,
                                 DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_GRAMMAR_WORKERS, DEFAULT_HEADER_TIMEOUT_S,
                                 DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_QUEUED, DEFAULT_MAX_REQUEST_BYTES,
                                 DEFAULT_SHUTDOWN_TIMEOUT_S, ServerConfig, default_allowed_hosts)

DEFAULT_MODEL_NAME = "infer-demo"
API_KEY_ENV = "INFER_API_KEY"


def require_server_extra() -> None:
    """SystemExit with the install command when the server's dependencies are missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"error: the server needs its extra ({exc}): pip install '{DISTRIBUTION}[server]' "
                         "(in a checkout: pip install -e '.[server]')") from None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server flags (network, security, limits) + engine flags."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    group.add_argument("--port", type=_port, default=8000, help="TCP port, 1..65535 (default: %(default)s)")
    group.add_argument("--served-model-name", default=None,
                       help=f"model id clients send; default: the --model directory's name (never its path), "
                            f"or {DEFAULT_MODEL_NAME!r} for the demo")
    group.add_argument("--max-queued-requests", type=_queue_limit, default=DEFAULT_MAX_QUEUED,
                       help="choices (a request with n=4 is 4) that may wait beyond the --max-batch-size running "
                            "ones; more get 429 + Retry-After, a request whose n exceeds both together 400; "
                            "0 = unlimited (default: %(default)s)")
    group.add_argument("--max-running-choices", type=_positive, default=None,
                       help="choices of one request decoded at once, the rest started as these finish "
                            "(default: half of --max-batch-size, at least 1)")
    group.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="seconds that SIGTERM / Ctrl-C waits for open requests before ending them with an "
                            "error (default: %(default)s)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="(default: %(default)s)")
    sec = parser.add_argument_group("security and limits")
    sec.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                     help=f"require 'Authorization: Bearer KEY' on every request but /health "
                          f"(default: ${API_KEY_ENV}, else no key)")
    sec.add_argument("--public-metrics", action="store_true",
                     help="serve /metrics without the API key (default: it needs the key when one is set)")
    sec.add_argument("--allowed-hosts", default=None,
                     help="comma-separated Host header names to answer, '*' for any (default: loopback names "
                          "when --host is a loopback address, else any)")
    sec.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                     help="larger request bodies get 413 (default: %(default)s)")
    sec.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                     help="seconds a connection has to send a request's headers, then it is closed "
                          "(default: %(default)s)")
    sec.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                     help="open client connections; more are closed as soon as accepted (default: %(default)s)")
    sec.add_argument("--allow-special-tokens", action="store_true",
                     help="parse special-token strings (e.g. <|eot_id|>) in prompts and messages as control "
                          "tokens (default: they are plain text; chat templates still insert the real ones)")
    grammar = parser.add_argument_group("structured outputs (grammars compiled in worker processes)")
    grammar.add_argument("--grammar-workers", type=int, default=DEFAULT_GRAMMAR_WORKERS,
                         help="processes compiling grammars (default: %(default)s)")
    grammar.add_argument("--grammar-timeout", type=float, default=DEFAULT_GRAMMAR_TIMEOUT_S,
                         help="seconds one grammar may take to compile; a slower one gets 400 (default: %(default)s)")
    grammar.add_argument("--grammar-max-memory-mib", type=int, default=DEFAULT_GRAMMAR_MAX_MEMORY_MIB,
                         help="memory one grammar's compile may take; more gets 400 (default: %(default)s)")
    grammar.add_argument("--grammar-cache-mib", type=int, default=DEFAULT_GRAMMAR_CACHE_MIB,
                         help="memory of the compiled grammars kept for reuse (default: %(default)s)")
    add_engine_args(parser)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {text!r}")
    return value


def _queue_limit(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-queued-requests must be >= 0, got {value}")
    return value or None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-running-choices must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--shutdown-timeout must be a number of seconds >= 0, got {text}")
    return value


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model's directory name or hub id (no local path is ever shown)."""
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(args.model)
    return path.resolve().name if path.exists() else str(args.model)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    hosts = (tuple(h for h in args.allowed_hosts.split(",") if h.strip()) if args.allowed_hosts
             else default_allowed_hosts(args.host))
    return ServerConfig(model_name=served_model_name(args), max_queued_requests=args.max_queued_requests,
                        api_key=args.api_key, public_metrics=args.public_metrics, allowed_hosts=hosts,
                        max_request_bytes=args.max_request_bytes, allow_special_tokens=args.allow_special_tokens,
                        shutdown_timeout_s=args.shutdown_timeout, max_running_choices=args.max_running_choices,
                        header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                        grammar_workers=args.grammar_workers, grammar_timeout_s=args.grammar_timeout,
                        grammar_max_memory_mib=args.grammar_max_memory_mib, grammar_cache_mib=args.grammar_cache_mib)


def build_app(args: argparse.Namespace):  # noqa: ANN201 - (FastAPI, AsyncEngine)
    """Validate every flag, load the engine, start its loop, and wrap it in the app."""
    from infer.engine.async_engine import AsyncEngine
    from infer.engine.engine import Engine
    from infer.server.app import create_app

    server_config = server_config_from_args(args)  # flag errors before the model loads
    config = engine_config_from_args(args)
    engine = AsyncEngine(Engine(config))
    # freeze start-up's objects: a full collection while serving then scans only what requests made
    gc.collect()
    gc.freeze()
    app = create_app(engine, server_config)
    try:
        app.state.server.grammars.start()  # (no request waits for the workers to start)
    except ValueError:
        pass  # no tokenizer or no xgrammar: a request asking for a grammar gets the 400 that says so
    return app, engine


def serve(args: argparse.Namespace) -> int:
    """Check the extra, the flags and the port, load, then serve until SIGTERM / Ctrl-C."""
    require_server_extra()
    from infer.server.launch import serve_app
    from infer.server.listen import bind

    from infer.server.connections import ensure_descriptors

    server_config = server_config_from_args(args)  # flag errors before the port is taken
    engine_config_from_args(args)
    ensure_descriptors(server_config.max_connections)
    sock = bind(args.host, args.port)  # a port in use fails here, before the model loads
    logging.basicConfig(format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("infer").setLevel(logging.DEBUG if args.log_level == "trace" else args.log_level.upper())
    try:
        app, engine = build_app(args)
        port = sock.getsockname()[1]
        print(f"serving {app.state.server.model_name!r} on http://{args.host}:{port}/v1"
              + (" (API key required)" if args.api_key else ""), file=sys.stderr)
        try:
            serve_app(app, sock, args.log_level)
        finally:
            app.state.server.close()
            engine.shutdown()
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    args = parser.parse_args(dash_flags(sys.argv[1:] if argv is None else list(argv)))
    from infer.distributed.group import is_torchrun_worker
    try:
        if is_torchrun_worker():  # (torchrun: rank 0 serves, the other ranks are its workers)
            from infer.distributed.worker import serve_torchrun_rank
            return serve_torchrun_rank(engine_config_from_args(args))
        return serve(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
