"""OpenAI-compatible HTTP server (FastAPI + uvicorn) around the engine's async interface.

    python -m infer.server --model DIR            # or: infer serve --model DIR

`infer.server.app.create_app(async_engine, server_config)` builds the app;
`infer.server.launch.LiveServer` runs one in a background thread (tests, benchmarks)."""
