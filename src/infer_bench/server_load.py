"""Load test of the OpenAI-compatible server over loopback: requests/s and latency percentiles.

    python -m infer_bench.server_load --num-requests 500 --concurrency 32 -- --model DIR --device cpu
    python -m infer_bench.server_load --url http://127.0.0.1:8000 --model-name NAME

Without --url it starts `python -m infer.server` in a subprocess (arguments after `--` go to
it). Every request is greedy with `ignore_eos`, so a response with fewer than max_tokens
tokens counts as truncated; half the requests stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

KEEPALIVE_EXPIRY_S = 2.0  # a client's idle connection lifetime (below servers' keep-alive timeouts)

DEFAULT_PROMPTS = ("The quick brown fox", "Once upon a time", "def forward(self, x):",
                   "The capital of France is", "Numbers like 1 2 3", "Every morning the robot")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of values (nan when empty)."""
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Reply:
    """What one request returned (text None when it failed)."""

    index: int
    streamed: bool
    text: str | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    error: str | None = None


@dataclass
class LoadResult:
    num_requests: int
    concurrency: int
    max_tokens: int
    wall_s: float = 0.0
    replies: list[Reply] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return [f"request {r.index}: {r.error}" for r in self.replies if r.error is not None]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.replies if r.error is None]
        lat = [r.latency_s for r in ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        tokens = sum(r.completion_tokens for r in ok)
        out: dict[str, Any] = {"requests": self.num_requests, "concurrency": self.concurrency,
                               "max_tokens": self.max_tokens, "completed": len(ok),
                               "errors": len(self.replies) - len(ok), "wall_s": round(self.wall_s, 3),
                               "requests_per_s": round(len(ok) / self.wall_s, 2) if self.wall_s else None,
                               "output_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else None}
        for name, values in (("latency", lat), ("ttft_stream", ttft)):
            out.update({f"{name}_p{q}_s": round(percentile(values, q), 4) for q in (50, 90, 99)})
        return out


def _check(reply: Reply, max_tokens: int) -> None:
    """Mark a reply that lost tokens or did not finish by length as an error."""
    if reply.error is None and (reply.completion_tokens != max_tokens or reply.finish_reason != "length"):
        reply.error = (f"truncated: {reply.completion_tokens}/{max_tokens} tokens, "
                       f"finish_reason {reply.finish_reason!r}")


async def _plain(client: httpx.AsyncClient, body: dict[str, Any], reply: Reply) -> None:
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        reply.error = f"HTTP {r.status_code}: {r.text[:200]}"
        return
    data = r.json()
    reply.text = data["choices"][0]["text"]
    reply.finish_reason = data["choices"][0]["finish_reason"]
    reply.completion_tokens = data["usage"]["completion_tokens"]


class StreamError(Exception):
    """A streamed completion that failed: an HTTP error, an error event, no `[DONE]`."""


async def sse_chunks(client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST a streamed completion and yield its JSON chunks; raise StreamError when it fails."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"error event: {chunk['error'].get('message')}")
            yield chunk
        if not done:
            raise StreamError("stream ended without [DONE]")


async def _streamed(client: httpx.AsyncClient, body: dict[str, Any], reply: Reply, start: float) -> None:
    parts: list[str] = []
    chunks = 0
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async for chunk in sse_chunks(client, streamed):
            if chunk.get("usage"):
                reply.completion_tokens = chunk["usage"]["completion_tokens"]
                continue
            if reply.ttft_s is None:
                reply.ttft_s = time.perf_counter() - start
            parts.append(chunk["choices"][0]["text"])
            chunks += 1  # the server sends one chunk per generated token
            reply.finish_reason = chunk["choices"][0]["finish_reason"] or reply.finish_reason
    except StreamError as error:
        reply.error = str(error)
    reply.text = "".join(parts)
    if reply.error is None and chunks != reply.completion_tokens:
        reply.error = f"{chunks} token chunks but usage says {reply.completion_tokens} tokens"


async def _one(client: httpx.AsyncClient, index: int, body: dict[str, Any], stream: bool,
               max_tokens: int) -> Reply:
    reply = Reply(index, stream)
    start = time.perf_counter()
    try:
        await (_streamed(client, body, reply, start) if stream else _plain(client, body, reply))
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.latency_s = time.perf_counter() - start
    _check(reply, max_tokens)
    return reply


async def run_load(base_url: str, model: str, prompts: list[str] | tuple[str, ...], num_requests: int = 500,
                   concurrency: int = 32, max_tokens: int = 16, timeout_s: float = 300.0) -> LoadResult:
    """Send num_requests greedy completions (prompts round robin, every other one streamed),
    at most `concurrency` at a time; collect every reply."""
    result = LoadResult(num_requests, concurrency, max_tokens)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    # idle connections are dropped after 2 s, before a server's keep-alive timeout (uvicorn's
    # default: 5 s) closes them: a request sent on a connection the server is closing fails
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            result.replies.append(await _one(client, i, body, i % 2 == 0, max_tokens))

    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - start
    result.replies.sort(key=lambda r: r.index)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(server_args: list[str], timeout_s: float,
                 capture_output: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m infer.server` on a free loopback port, once /health answers: (process, url).
    capture_output: its stdout and stderr go to one pipe (read it after terminating)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "infer.server", "--port", str(port), "--log-level", "warning", *server_args]
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if capture_output else {}
    proc = subprocess.Popen(cmd, **pipe)  # type: ignore[call-overload]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.communicate()[0].decode() if capture_output else ""
            raise RuntimeError(f"server exited with code {proc.returncode}: {' '.join(cmd)}\n{output}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling the server's startup
    proc.terminate()
    raise RuntimeError(f"server did not become healthy within {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infer_bench.server_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an already running server (default: start one)")
    parser.add_argument("--model-name", default=None, help="model id to send (default: GET /v1/models)")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8, help="requests sent (and not counted) first")
    parser.add_argument("server_args", nargs="*", help="flags for python -m infer.server (after --)")
    args = parser.parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args.server_args, 600.0)
    try:
        model = args.model_name or httpx.get(url + "/v1/models").json()["data"][0]["id"]
        if args.warmup:
            asyncio.run(run_load(url, model, DEFAULT_PROMPTS, args.warmup, min(args.warmup, args.concurrency),
                                 args.max_tokens))
        result = asyncio.run(run_load(url, model, DEFAULT_PROMPTS, args.num_requests, args.concurrency,
                                      args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = result.summary()
    print(json.dumps(summary))
    print(f"{summary['completed']}/{summary['requests']} ok, {summary['errors']} errors; "
          f"{summary['requests_per_s']} req/s, {summary['output_tokens_per_s']} tok/s; latency p50/p90/p99 "
          f"{summary['latency_p50_s']}/{summary['latency_p90_s']}/{summary['latency_p99_s']} s", file=sys.stderr)
    for line in result.errors[:10]:
        print(line, file=sys.stderr)
    return 0 if not result.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
