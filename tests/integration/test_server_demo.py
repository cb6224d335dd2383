"""The server with the bundled demo pair (no --model): speculative decoding with the trained
demo draft; greedy outputs equal `LLM.generate` on the demo target without speculation,
through the official `openai` client, streamed and not. Skipped when the demo models are
not installed (they are built by the demo-pair training run).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from infer import LLM, EngineConfig, SamplingParams
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
from infer.server.launch import LiveServer

pytestmark = pytest.mark.skipif(not (DEMO_TARGET / "config.json").exists() or not (DEMO_DRAFT / "config.json").exists(),
                                reason="demo models not installed")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def expected() -> list[str]:
    llm = LLM(device="cpu")  # the demo target, plain decoding
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def demo_server() -> Iterator[LiveServer]:
    live = LiveServer.start(EngineConfig(device="cpu", use_speculative_decoding=True), "infer-demo")
    yield live
    live.settle()
    assert live.leak_report() == []
    live.stop()


def test_demo_pair_speculative_server_equals_plain_llm(demo_server: LiveServer, expected: list[str]) -> None:
    api = OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        r = api.completions.create(model="infer-demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want
        stats = r.model_extra["speculative_decoding"]
        assert 0.0 <= stats["acceptance_rate"] <= 1.0 and stats["mean_accepted_length"] >= 1.0
        chunks = api.completions.create(model="infer-demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        stream=True)
        assert "".join(c.choices[0].text for c in chunks) == want
    assert [m.id for m in api.models.list().data] == ["infer-demo"]
