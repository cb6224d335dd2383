"""The agent workload (bench/agent.py: tool-calling requests sharing a preamble, run one
after another) and suffix decoding's benchmark runs: repeats start from an empty cache of
earlier outputs (`Engine.reset_draft_history`), so they take the same steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from infer_bench import engine_runner
from infer_bench.engine_runner import engine_config, run_engine
from infer_bench.workloads import WORKLOADS, build_requests
from infer.engine.engine import Engine
from infer.tokenization import Tokenizer


def test_agent_prompts_share_their_preamble_and_answer_start(ckpt_a):
    agent = WORKLOADS["agent"]
    assert (agent.num_requests, agent.concurrency, agent.kind) == (16, 1, "agent")
    dummy = build_requests(agent, 1000).requests
    assert [r.prompt_ids for r in dummy] == [r.prompt_ids for r in build_requests(agent, 1000).requests]
    assert all(len(r.prompt_ids) == 384 and r.max_tokens == 96 for r in dummy)
    assert len({tuple(r.prompt_ids[:364]) for r in dummy}) == 1 and len({tuple(r.prompt_ids[-4:]) for r in dummy}) == 1
    assert len({tuple(r.prompt_ids[364:380]) for r in dummy}) > 1  # a task each
    tok = Tokenizer.from_pretrained(ckpt_a)
    texts = [tok.decode(r.prompt_ids) for r in build_requests(agent, tok.vocab_size, tok).requests]
    assert all(t.endswith('Call: {"name": "') and "Tools:" in t for t in texts)
    assert len({t.split("Task:")[0] for t in texts}) == 1 and len({t.split("Task:")[1] for t in texts}) > 8
    with pytest.raises(ValueError, match="prompt_len"):
        build_requests(replace(agent, prompt_len=(40, 40)), tok.vocab_size, tok)
    with pytest.raises(ValueError, match="concurrency"):
        replace(agent, concurrency=0)
    assert engine_config(agent, {}, device="cpu").max_batch_size == 1  # its concurrency: one at a time


def test_repeats_of_suffix_decoding_start_from_an_empty_cache(ckpt_a, monkeypatch):
    # each timed run's requests draft from what the runs before it left only when the
    # engine's history is not reset: with the reset, repeats take the same steps
    wl = replace(WORKLOADS["agent"], num_requests=3, output_len=(12, 12))
    steps: list[int] = []
    real = engine_runner.timed_run

    def recording(engine, workload, specs):
        out = real(engine, workload, specs)
        steps.append(out.steps)
        return out

    monkeypatch.setattr(engine_runner, "timed_run", recording)
    spec = {"model": str(ckpt_a), "speculative_method": "suffix", "spec_length": 3}
    run_engine(wl, spec, device="cpu", warmup_tokens=0, repeats=2)
    assert len(steps) == 2 and steps[0] == steps[1]
    monkeypatch.setattr(Engine, "reset_draft_history", lambda self: None)
    run_engine(wl, spec, device="cpu", warmup_tokens=0, repeats=2)
    assert steps[2] == steps[0] and steps[3] < steps[2]  # the repeat drafted the first run's outputs
