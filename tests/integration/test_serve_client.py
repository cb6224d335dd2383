"""The serving benchmark's client against our CPU server with the demo model (no timing
asserted): two small rates, a few requests each; every request answered or counted as
failed, the rows' percentile fields, the report and chart read them, our server's process
ends with the session."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from infer import EngineConfig
from infer_bench.harness import Harness
from infer_bench.report import markdown
from infer_bench.results import BenchRun, load_run
from infer_bench.rows import HarnessOptions
from infer_bench.serve import SERVE_KIND, ServeSession, ServeSetup, serve_rows
from infer_bench.serve_client import RateResult, ServeRecord, run_rate, server_facts, summarize
from infer_bench.serve_mix import SHAREGPT_LIKE, ServeRequest, draw_requests, poisson_schedule
from infer.engine.loading import DEMO_TARGET
from infer.server.launch import LiveServer

RATES = (4.0, 16.0)
NUM = 6
OUTPUT_LEN = 6
CONTEXT = 256
PERCENTILES = [f"{s}_{q}_s" for s in ("ttft", "tpot", "e2e") for q in ("p50", "p99")]


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    config = EngineConfig(model=str(DEMO_TARGET), device="cpu", max_batch_size=4, max_seq_len=CONTEXT)
    with LiveServer.start(config, "demo") as server:
        yield server
        server.settle()
        assert server.leak_report() == []


def test_the_client_streams_every_request_and_counts_failures(live: LiveServer) -> None:
    model, context = asyncio.run(server_facts(live.url))
    assert (model, context) == ("demo", CONTEXT)
    good = draw_requests(SHAREGPT_LIKE.within(context), NUM, seed=0, output_len=OUTPUT_LEN)
    too_long = ServeRequest(NUM, (200,) * CONTEXT, 4)  # beyond the context: the server answers 400
    requests = [*good, too_long]
    result = asyncio.run(run_rate(live.url, model, requests, poisson_schedule(8.0, len(requests), 1), 8.0, 120.0))
    assert [r.index for r in result.records] == list(range(NUM + 1))
    failed = [r for r in result.records if r.error is not None]
    assert [r.index for r in failed] == [NUM] and "HTTP 400" in (failed[0].error or "")
    for rec, req in zip(result.records[:NUM], good):
        assert rec.output_tokens == OUTPUT_LEN and rec.prompt_tokens == len(req.prompt_ids)
        assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.e2e_s and rec.tpot_s is not None
    m = summarize(result)
    assert (m["requests"], m["completed"], m["failed"]) == (NUM + 1, NUM, 1)
    assert m["output_tokens"] == NUM * OUTPUT_LEN and len(m["errors"]) == 1
    assert all(m[k] is not None and m[k] >= 0 for k in PERCENTILES)
    assert m["ttft_p50_s"] <= m["ttft_p99_s"] and m["e2e_p50_s"] <= m["e2e_p99_s"]


def test_summary_of_a_rate_where_everything_failed() -> None:
    m = summarize(RateResult(1.0, 2.0, [ServeRecord(0, 5, 4, error="timed out after 1 s")]))
    assert (m["completed"], m["failed"], m["request_throughput"]) == (0, 1, 0.0)
    assert all(m[k] is None for k in PERCENTILES)


def test_the_suite_rows_against_a_url_give_rows_the_report_and_chart_read(live: LiveServer,
                                                                         tmp_path: Path) -> None:
    setup = ServeSetup(rates=RATES, num_prompts=NUM, url=live.url, warmup=1)
    rows = {r.name: r for r in serve_rows(setup, "unused", ())}
    assert list(rows) == ["serve/peer/r4", "serve/peer/r16"]
    run = BenchRun("serve")
    out = tmp_path / "serve.json"
    Harness(run, HarnessOptions(device="cpu", output_len=OUTPUT_LEN, quiet=True), out).run_rows(list(rows), rows)
    for rate, m in zip(RATES, run.measurements):
        assert m.ok and m.kind == SERVE_KIND, m.error
        assert m.params["request_rate"] == rate and m.params["num_prompts"] == NUM
        assert m.metrics["completed"] + m.metrics["failed"] == NUM and m.metrics["failed"] == 0
        assert all(m.metrics[k] is not None for k in PERCENTILES)
        assert m.derived["completed_fraction"] == 1.0 and m.derived["of_offered_rate"] > 0
    # the same requests at every rate (the seeded mix), only the arrivals differ
    assert run.measurements[0].metrics["prompt_tokens"] == run.measurements[1].metrics["prompt_tokens"]
    saved = load_run(out)
    assert "TTFT p99" in markdown(saved) and "| 16 |" in markdown(saved)
    pytest.importorskip("matplotlib")
    from infer_bench.serve_plot import plot_serving
    path = plot_serving(saved, tmp_path / "charts")
    assert path is not None and path.stat().st_size > 0


def test_the_session_starts_our_server_and_stops_it_after_the_last_row(tmp_path: Path) -> None:
    setup = ServeSetup(rates=(math.inf,), num_prompts=2, warmup=0, startup_timeout_s=300.0,
                       engine={"model": str(DEMO_TARGET), "max_seq_len": CONTEXT})
    session = ServeSession(setup, rows=1)
    harness = Harness(BenchRun("serve"), HarnessOptions(device="cpu", output_len=2, quiet=True))
    target = session.target(harness)
    proc = session.process
    assert proc is not None and proc.poll() is None
    assert target.url.startswith("http://127.0.0.1:") and target.context_len == CONTEXT
    assert "--max-queued-requests" in target.server_args and "--device" in target.server_args
    session.finish_row()
    assert proc.poll() is not None  # terminated and reaped
