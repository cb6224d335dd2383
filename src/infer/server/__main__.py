"""`python -m infer.server` / `infer serve`: the OpenAI-compatible HTTP server.

    python -m infer.server                                  # the bundled demo pair
    python -m infer.server --model ./my-llama --speculative-decoding --draft-model ./my-draft \
        --port 8000 --served-model-name llama

Engine flags are the same as `infer generate` (see `infer.engine.args`).
"""

from __future__ import annotations

import argparse
import sys

from infer.engine.args import add_engine_args, engine_config_from_args

DEFAULT_MODEL_NAME = "infer-demo"
DEFAULT_MAX_QUEUED = 1024


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Server flags (--host, --port, --served-model-name, --max-queued-requests) + engine flags."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    group.add_argument("--served-model-name", default=None,
                       help=f"model id clients send; default: --model, or {DEFAULT_MODEL_NAME!r} for the demo")
    group.add_argument("--max-queued-requests", type=_queue_limit, default=DEFAULT_MAX_QUEUED,
                       help="waiting requests beyond which new ones get 429 + Retry-After; "
                            "0 = unlimited (default: %(default)s)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser)


def _queue_limit(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--max-queued-requests must be >= 0, got {value}")
    return value or None


def build_app(args: argparse.Namespace):  # noqa: ANN201 - (FastAPI, AsyncEngine)
    """Load the engine from the parsed flags, start its loop, and wrap it in the app."""
    from infer.engine.async_engine import AsyncEngine
    from infer.engine.engine import Engine
    from infer.server.app import create_app

    config = engine_config_from_args(args)
    engine = AsyncEngine(Engine(config), args.max_queued_requests)
    name = args.served_model_name or config.model or DEFAULT_MODEL_NAME
    return create_app(engine, name, args.max_queued_requests), engine


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    app, engine = build_app(args)
    print(f"serving {app.state.server.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer.server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
