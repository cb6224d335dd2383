"""Defaults an engine resolves when it is built (engine/defaults.py, engine/executor/capture.py,
engine/startup.py): CUDA graphs follow the device (off on a CPU, where asking for them is
refused with the fix), FP8 weights on a CPU warn, speculation fields turn speculation on in
the library as on the command line, the demo target drafts with its own EAGLE-3 head, vLLM's
option names point to ours, graphs are captured for a bounded list of batch sizes and
contexts, and the start-up is logged phase by phase. A server without xgrammar refuses a
structured output naming the extra."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest

from infer.engine.config import EngineConfig
from infer.engine.defaults import check_device_options, resolve_config
from infer.engine.executor.capture import MAX_CAPTURE_SIZE, MAX_GRAPH_CONTEXT, capture_sizes, graph_context_width


def test_cuda_graphs_follow_the_device_and_a_cpu_refuses_them(ckpt_a: Path) -> None:
    import torch

    config = EngineConfig(model=str(ckpt_a), device="cpu")
    execution = resolve_config(config).execution
    assert config.use_cuda_graphs is None  # (the user's config is left as given)
    assert (execution.use_cuda_graphs, execution.compile_kernels, execution.async_scheduling) == (False, False, False)
    with pytest.raises(ValueError, match="use_cuda_graphs=True needs a CUDA device, but this engine runs on cpu: "
                                         "drop use_cuda_graphs"):
        resolve_config(EngineConfig(model=str(ckpt_a), device="cpu", use_cuda_graphs=True))
    assert check_device_options(EngineConfig(use_cuda_graphs=True), torch.device("cuda")) == []
    assert check_device_options(EngineConfig(use_cuda_graphs=False), torch.device("cpu")) == []


def test_fp8_weights_on_a_cpu_warn_that_they_decode_slower(ckpt_a: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    warnings = check_device_options(EngineConfig(quantization="fp8"), torch.device("cpu"))
    assert len(warnings) == 1 and "decodes slower than float32 weights" in warnings[0]
    assert "no FP8 matmul" in warnings[0] and "leave quantization unset" in warnings[0]
    (int4,) = check_device_options(EngineConfig(draft_quantization="int4"), torch.device("cpu"))
    assert "no INT4 matmul" in int4 and "leave draft_quantization unset" in int4
    assert check_device_options(EngineConfig(quantization="int4"), torch.device("cuda")) == []
    with caplog.at_level(logging.WARNING, logger="infer.engine"):
        resolve_config(EngineConfig(model=str(ckpt_a), device="cpu", quantization="fp8"))
    assert [r.message for r in caplog.records] == warnings


def test_speculation_fields_turn_speculation_on_in_the_library() -> None:
    assert EngineConfig().use_speculative_decoding is False
    assert EngineConfig(spec_length=3).use_speculative_decoding is True
    assert EngineConfig(speculative_method="ngram", ngram_max_order=6).use_speculative_decoding is True
    with pytest.raises(ValueError, match="^spec_tree, spec_policy configure speculative decoding, which "
                                         "use_speculative_decoding=False turns off"):
        EngineConfig(use_speculative_decoding=False, spec_tree="2,1", spec_policy="adaptive")
    plain = EngineConfig(use_speculative_decoding=False)
    assert dataclasses.replace(plain, model="m").use_speculative_decoding is False  # (its filled-in K is no setting)


def test_vllm_option_names_point_to_ours() -> None:
    with pytest.raises(ValueError, match=r"enforce_eager: use use_cuda_graphs=False; max_model_len: use max_seq_len"):
        EngineConfig.from_kwargs(enforce_eager=True, max_model_len=4096)


def test_the_demo_target_drafts_with_its_own_eagle3_head() -> None:
    from infer import LLM, SamplingParams
    from infer.engine.loading import DEMO_EAGLE3
    from infer.speculative.eagle import EagleProposer

    with LLM(use_speculative_decoding=True, speculative_method="eagle3", device="cpu", max_batch_size=1) as llm:
        assert isinstance(llm.engine.runner.speculation.proposer, EagleProposer)
        out = llm.generate("def is_prime(n):\n", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
        assert len(out.token_ids) == 8 and out.acceptance_rate is not None
    assert (DEMO_EAGLE3 / "config.json").is_file()
    with pytest.raises(ValueError, match="speculative_method='eagle' requires draft_model.*ships an EAGLE-3 head"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative_method='eagle3' requires draft_model"):
        EngineConfig(model="some/model", speculative_method="eagle3")


def test_graphs_are_captured_for_a_bounded_list_of_sizes_and_contexts() -> None:
    assert capture_sizes(1) == [1] and capture_sizes(6) == [1, 2, 4, 6] and capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(256) == [1 << i for i in range(9)]
    assert capture_sizes(5000) == [1 << i for i in range(MAX_CAPTURE_SIZE.bit_length())]  # larger: eager
    assert graph_context_width(1024) == 1024 and graph_context_width(131072) == MAX_GRAPH_CONTEXT


def test_the_startup_is_logged_phase_by_phase(ckpt_a: Path, caplog: pytest.LogCaptureFixture) -> None:
    from infer.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="infer.engine"):
        engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", use_speculative_decoding=True,
                                     draft_model=str(ckpt_a), max_seq_len=64))
    ready = [r.message for r in caplog.records if r.message.startswith("engine ready in")]
    assert len(ready) == 1 and "weights loaded in" in ready[0] and "no CUDA graphs (eager)" in ready[0]
    pools = [engine.runner.cache_pool, *engine.runner.speculation.pools()]
    assert engine.startup.kv_bytes == sum(2 * p.k_cache.numel() * p.k_cache.element_size() for p in pools)
    assert f"KV cache of {min(p.total_token_capacity() for p in pools):,} tokens" in ready[0]
    assert "max_seq_len 64, max_batch_size 8" in ready[0]
    assert set(engine.startup.phases) == {"load", "runner"} and engine.startup.num_graphs() == 0


def test_a_server_without_xgrammar_refuses_structured_outputs_naming_the_extra(
        ckpt_a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from infer.server.launch import LiveServer

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    monkeypatch.delitem(sys.modules, "infer.engine.structured", raising=False)
    with LiveServer.start(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=64), "m") as live:
        with pytest.raises(ValueError, match=r"infer-engine\[structured\]"):
            live.state.grammars.start()  # as `infer serve` does at start-up (which skips this ValueError)
        plain = httpx.post(live.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2})
        assert plain.status_code == 200
        r = httpx.post(live.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2,
                                                           "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "pip install 'infer-engine[structured]'" in r.json()["error"]["message"]
        live.settle()
        assert live.leak_report() == []
