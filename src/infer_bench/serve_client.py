"""The serving benchmark's client: open-loop streamed completions at scheduled times, and the
per-rate statistics (TTFT, TPOT, end-to-end latency, throughput), as `vllm bench serve`
defines them. A request that errs, returns fewer tokens than asked, ends its stream without
`[DONE]` or outlives `timeout_s` counts as failed with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from infer_bench.serve_mix import ServeRequest
from infer_bench.server_load import KEEPALIVE_EXPIRY_S, StreamError, percentile, sse_chunks

ERRORS_KEPT = 5  # failure messages kept in a row's metrics


@dataclass
class ServeRecord:
    """One request's outcome (times in seconds from its send)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error is not None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RateResult:
    rate: float
    wall_s: float = 0.0  # first send to last answer
    records: list[ServeRecord] = field(default_factory=list)


async def server_facts(base_url: str, timeout_s: float = 30.0) -> tuple[str, int | None]:
    """(model id, its context length or None) from GET /v1/models (ours and vLLM report
    `max_model_len`)."""
    limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)  # (server_load.py says why)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        card = r.json()["data"][0]
    context = card.get("max_model_len")
    return str(card["id"]), int(context) if context else None


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], rec: ServeRecord, start: float) -> None:
    chunks = 0
    try:
        async for chunk in sse_chunks(client, body):
            if chunk.get("choices"):
                chunks += 1
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                rec.output_tokens = int(chunk["usage"]["completion_tokens"])
    except StreamError as error:
        rec.error = str(error)
        return
    if rec.output_tokens == 0:
        rec.output_tokens = chunks  # a server that sends no usage: one chunk a token
    if rec.output_tokens != rec.max_tokens:
        rec.error = f"truncated: {rec.output_tokens}/{rec.max_tokens} tokens"


async def _one(client: httpx.AsyncClient, model: str, req: ServeRequest, timeout_s: float) -> ServeRecord:
    rec = ServeRecord(req.index, len(req.prompt_ids), req.output_len)
    body = {"model": model, "prompt": list(req.prompt_ids), "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, body, rec, start), timeout_s)
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g} s"
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e_s = time.perf_counter() - start
    return rec


async def run_rate(base_url: str, model: str, requests: Sequence[ServeRequest], schedule: Sequence[float],
                   rate: float, timeout_s: float) -> RateResult:
    """Send requests[i] at schedule[i] seconds from now, each streamed, all at most `timeout_s`
    long; returns when every one has finished or failed."""
    if len(requests) != len(schedule):
        raise ValueError(f"{len(requests)} requests but {len(schedule)} send times")
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    result = RateResult(rate)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = loop.time()

        async def fire(req: ServeRequest, at: float) -> ServeRecord:
            await asyncio.sleep(max(0.0, start + at - loop.time()))  # the arrival time
            return await _one(client, model, req, timeout_s)

        result.records = list(await asyncio.gather(*(fire(r, t) for r, t in zip(requests, schedule))))
        result.wall_s = loop.time() - start
    return result


def summarize(result: RateResult) -> dict[str, Any]:
    """The row's metrics: counts, throughput and TTFT / TPOT / E2E mean, p50 and p99 (seconds)."""
    ok = [r for r in result.records if r.error is None]
    wall = result.wall_s
    out_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, Any] = {
        "requests": len(result.records), "completed": len(ok), "failed": len(result.records) - len(ok),
        "duration_s": wall, "request_throughput": len(ok) / wall if wall > 0 else None,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else None,
        "input_tokens_per_s": sum(r.prompt_tokens for r in ok) / wall if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in result.records), "output_tokens": out_tokens,
        "errors": [f"request {r.index}: {r.error}" for r in result.records if r.error is not None][:ERRORS_KEPT]}
    series = {"ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
              "tpot": [t for t in (r.tpot_s for r in ok) if t is not None], "e2e": [r.e2e_s for r in ok]}
    for name, values in series.items():
        metrics[f"{name}_mean_s"] = sum(values) / len(values) if values else None
        for q in (50, 99):
            metrics[f"{name}_p{q}_s"] = percentile(values, q) if values else None
    return metrics
