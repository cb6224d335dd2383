"""`infer bench --suite serve`: open-loop serving at several request rates, one row a rate.

    infer bench --suite serve --device cpu --request-rates 1,4 --num-prompts 20 --output-len 16
    infer bench --suite serve --url http://127.0.0.1:8000      # any OpenAI-compatible server

Without --url a `ServeSession` starts our server (with `infer bench`'s engine flags) before
the first row and stops it after the last. Each rate sends the same requests of the
ShareGPT-like mix (bench/serve_mix.py) with Poisson arrivals after a few warm-up requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_bench.rows import Context, Module, Need, Outcome, Row
from infer_bench.serve_mix import SHAREGPT_LIKE, LengthMix, draw_requests, poisson_schedule

SERVE_KIND = "serve"
DEFAULT_RATES = (1.0, 4.0, 16.0)
WARMUP_SEED = 1_000_003  # warm-up requests differ from the measured ones
HTTPX = Module("httpx", "infer-engine[server]")
FASTAPI = Module("fastapi", "infer-engine[server]")
UVICORN = Module("uvicorn", "infer-engine[server]")


def parse_rates(text: str) -> tuple[float, ...]:
    """"1,4,16" (or "inf": everything at once) -> (1.0, 4.0, 16.0); ValueError naming the flag."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--request-rates takes numbers (requests/s) or inf separated by commas, got {text!r}") \
            from None
    if not rates or any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--request-rates needs distinct rates > 0 (requests/s, or inf), got {text!r}")
    return rates


@dataclass(frozen=True)
class ServeSetup:
    """What the serve suite sends, and where."""

    rates: tuple[float, ...] = DEFAULT_RATES  # requests/s; inf = all at once
    num_prompts: int = 100  # requests per rate
    url: str | None = None  # a running server; None = ours, started on 127.0.0.1
    request_timeout_s: float = 300.0
    startup_timeout_s: float = 900.0
    warmup: int = 4
    seed: int = 0
    mix: LengthMix = SHAREGPT_LIKE
    engine: Mapping[str, Any] = field(default_factory=dict)  # EngineConfig fields for our server

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates) or len(set(self.rates)) != len(self.rates):
            raise ValueError(f"request rates must be distinct and > 0 (or inf), got {self.rates}")
        if self.num_prompts < 1 or self.warmup < 0:
            raise ValueError(f"num_prompts must be >= 1 and warmup >= 0, got {self.num_prompts}, {self.warmup}")
        if not self.request_timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ValueError("request_timeout_s and startup_timeout_s must be > 0")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http(s) base URL such as http://127.0.0.1:8000, got {self.url!r}")

    @property
    def label(self) -> str:
        return "ours" if self.url is None else "peer"


def rate_tag(rate: float) -> str:
    return "rinf" if math.isinf(rate) else f"r{rate:g}"


def server_flags(engine: Mapping[str, Any]) -> list[str]:
    """`python -m infer.server` flags for the EngineConfig fields that differ from their defaults."""
    from infer.engine.args import flag
    from infer.engine.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    out: list[str] = []
    for name, value in engine.items():
        if name not in defaults:
            raise ValueError(f"{name!r} is no EngineConfig field")
        if value == defaults[name]:
            continue
        option = flag(name)
        if isinstance(value, bool):
            out.append(option if value else "--no-" + option.removeprefix("--"))
        else:
            out += [option, str(value)]
    return out


@dataclass
class Target:
    url: str
    model: str
    context_len: int | None
    server_args: list[str]


class ServeSession:
    """The server the suite's rows share: started (ours) and warmed up before the first row,
    stopped after the last (`rows` of them) or, for a run cut short, when the session is
    collected or the interpreter exits."""

    def __init__(self, setup: ServeSetup, rows: int) -> None:
        self.setup, self.rows_left = setup, rows
        self._target: Target | None = None
        self._failed: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop: weakref.finalize | None = None

    def target(self, ctx: Context) -> Target:
        if self._failed is not None:
            raise RuntimeError(self._failed)
        if self._target is None:
            try:
                self._target = self._start(ctx)
            except Exception as exc:
                self._failed = f"the server for the serve suite did not come up: {type(exc).__name__}: {exc}"
                self.close()
                raise
        return self._target

    def _start(self, ctx: Context) -> Target:
        from infer_bench.serve_client import run_rate, server_facts
        from infer_bench.server_load import start_server

        args: list[str] = []
        url = self.setup.url
        if url is None:
            args = ["--max-queued-requests", "0", *server_flags({**self.setup.engine, "device": str(ctx.device)})]
            self._proc, url = start_server(args, self.setup.startup_timeout_s)
            self._stop = weakref.finalize(self, _terminate, self._proc)
        model, context = asyncio.run(server_facts(url))
        target = Target(url, model, context, args)
        if self.setup.warmup:
            warm = draw_requests(self.setup.mix.within(context), self.setup.warmup, WARMUP_SEED,
                                 ctx.options.output_len)
            asyncio.run(run_rate(url, model, warm, [0.0] * len(warm), math.inf, self.setup.request_timeout_s))
        return target

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """Our server's process (None with --url or before the first row)."""
        return self._proc

    def finish_row(self) -> None:
        self.rows_left -= 1
        if self.rows_left <= 0:
            self.close()

    def close(self) -> None:
        if self._stop is not None:
            self._stop()  # terminates our server once (a no-op when already done)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def measure_rate(target: Target, setup: ServeSetup, rate: float, output_len: int | None) -> Outcome:
    """One rate: the setup's requests (clipped to the server's context) at Poisson arrivals."""
    from infer_bench.serve_client import run_rate, summarize

    mix = setup.mix.within(target.context_len)
    requests = draw_requests(mix, setup.num_prompts, setup.seed, output_len)
    schedule = poisson_schedule(rate, setup.num_prompts, setup.seed + 1)
    result = asyncio.run(run_rate(target.url, target.model, requests, schedule, rate, setup.request_timeout_s))
    params = {"url": target.url if setup.url is not None else "ours (127.0.0.1)", "model": target.model,
              "request_rate": rate if math.isfinite(rate) else "inf", "num_prompts": setup.num_prompts,
              "seed": setup.seed, "mix": dataclasses.asdict(mix), "output_len": output_len,
              "context_len": target.context_len, "request_timeout_s": setup.request_timeout_s,
              "server_args": target.server_args}
    return params, summarize(result)


def serve_rows(setup: ServeSetup, model: str, needs: tuple[Need, ...]) -> list[Row]:
    """One row a rate, sharing one server (`model` and `needs`: ours, when no URL is given)."""
    ours = setup.url is None
    group = f"serving, {setup.label}: " + (Path(model).name or model if ours else setup.url or "")
    row_needs = (HTTPX, FASTAPI, UVICORN, *needs) if ours else (HTTPX,)
    session = ServeSession(dataclasses.replace(setup, engine={**setup.engine, "model": model}) if ours else setup,
                           len(setup.rates))

    def row(rate: float) -> Row:
        def run(ctx: Context) -> Outcome:
            try:
                return measure_rate(session.target(ctx), session.setup, rate, ctx.options.output_len)
            finally:
                session.finish_row()

        what = (f"{setup.num_prompts} requests, Poisson arrivals at {rate:g}/s, ShareGPT-like lengths, streamed "
                f"({'our server' if ours else setup.url})")
        return Row(f"serve/{setup.label}/{rate_tag(rate)}", what, SERVE_KIND, group, run, {}, row_needs)

    return [row(r) for r in setup.rates]


def serve_derived(metrics: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Ratios of a serve row: the share of requests completed and the achieved request rate
    over the offered one (below 1: the server could not keep up, or the run was short)."""
    out: dict[str, Any] = {}
    if metrics.get("requests"):
        out["completed_fraction"] = metrics.get("completed", 0) / metrics["requests"]
    rate, achieved = params.get("request_rate"), metrics.get("request_throughput")
    if isinstance(rate, (int, float)) and rate > 0 and achieved is not None:
        out["of_offered_rate"] = achieved / rate
    return out
