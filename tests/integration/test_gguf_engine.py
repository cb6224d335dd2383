"""GGUF files through the whole engine: speculative decoding with a GGUF target and a GGUF
draft is lossless, and `infer generate` and the server take a .gguf model as they take a
directory (the file's own tokenizer and chat template included)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from openai import OpenAI

from helpers.gguf_files import write_gguf
from infer import LLM, EngineConfig, SamplingParams
from infer.cli import main
from infer.server.launch import LiveServer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def forward(self, input_ids):", "Numbers like 1 2 3 appear"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, ckpt_a: Path, ckpt_b: Path) -> dict[str, Path]:
    """A Q8_0 target (tied, llama3 RoPE) and a Q4_0 draft (another model, same vocabulary)."""
    out = tmp_path_factory.mktemp("gguf_engine")
    return {"target": write_gguf(ckpt_a, out / "target-q8_0.gguf", Q.Q8_0),
            "draft": write_gguf(ckpt_b, out / "draft-q4_0.gguf", Q.Q4_0)}


@pytest.mark.parametrize("draft", ["draft", "target"], ids=["other-draft", "self-draft"])
def test_speculation_with_gguf_target_and_draft(make_llm: Callable[..., LLM], files: dict[str, Path],
                                                draft: str) -> None:
    plain = make_llm(files["target"])
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    outs = plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    expected = [o.outputs[0].token_ids for o in outs]
    spec = make_llm(files["target"], use_speculative_decoding=True, draft_model=str(files[draft]),
                    spec_length=4)
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected  # lossless
    rates = [o.outputs[0].acceptance_rate for o in outs]
    assert None not in rates  # the draft file really drafted
    if draft == "target":  # a model drafting for itself is always right: every round is accepted
        assert rates == [1.0] * len(outs)


def test_cli_generate_with_gguf_files(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", str(files["target"]), "--device", "cpu", "--prompt", "The quick",
                 "--max-tokens", "8", "--speculative-decoding", "--draft-model", str(files["target"]),
                 "--spec-length", "3"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("The quick") and "acceptance 1.00" in out


def test_server_chat_with_a_gguf_model(make_llm: Callable[..., LLM], files: dict[str, Path]) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = make_llm(files["target"]).chat(messages, SamplingParams(temperature=0, max_tokens=8))
    live = LiveServer.start(EngineConfig(model=str(files["target"]), device="cpu"), "tiny-gguf")
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny-gguf", messages=messages, max_tokens=8,
                                               temperature=0)
        live.settle()
        assert live.leak_report() == []
    finally:
        live.stop()
    assert reply.choices[0].message.content == expected[0].outputs[0].text
