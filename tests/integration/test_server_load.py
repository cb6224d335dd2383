"""Load test over loopback: 500 requests at concurrency 32 against a live server, half of
them streamed; zero errors, and every response complete and equal to `LLM.generate`.

Bounded in count (500 requests of 8 tokens) and time (each request times out after 120 s).
`python -m infer_bench.server_load` runs the same load against a server subprocess and
prints requests/s and latency percentiles.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from infer import LLM, EngineConfig, SamplingParams
from infer_bench.server_load import DEFAULT_PROMPTS, run_load
from infer.server.launch import LiveServer

MODEL = "tiny"
MAX_TOKENS = 8
NUM_REQUESTS = 500
CONCURRENCY = 32


def test_500_requests_at_concurrency_32_all_complete_and_correct(ckpt_a: Path) -> None:
    llm = LLM(str(ckpt_a), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(list(DEFAULT_PROMPTS), greedy)]
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=CONCURRENCY)
    with LiveServer.start(config, MODEL, max_queued_requests=2 * CONCURRENCY) as live:
        result = asyncio.run(run_load(live.url, MODEL, DEFAULT_PROMPTS, NUM_REQUESTS, CONCURRENCY,
                                      MAX_TOKENS, timeout_s=120.0))
        live.settle()
        assert live.leak_report() == []
    assert result.errors == []
    assert [r.index for r in result.replies] == list(range(NUM_REQUESTS))
    assert sum(r.streamed for r in result.replies) == NUM_REQUESTS // 2
    for reply in result.replies:  # complete (checked by run_load: max_tokens tokens, [DONE]) and right
        assert reply.text == expected[reply.index % len(DEFAULT_PROMPTS)]
    summary = result.summary()
    assert summary["completed"] == NUM_REQUESTS and summary["errors"] == 0
