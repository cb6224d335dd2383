"""`infer chat` driven through its stdin: each answer streams and is followed by its speed,
the conversation is kept (each prompt holds the exchanges before it) until /clear, the system
prompt stays, /exit ends it; a conversation longer than the context drops its oldest
exchanges, a message alone too long is an error line and the chat goes on; a model without
a chat template gets a plain transcript. Nothing is left held in the engine."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path
from typing import Any

import pytest

from infer.chat import TRANSCRIPT_STOP, Chat, run_chat, transcript
from infer.cli import main
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
def engine(ckpt_a: Path) -> Engine:
    return Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=96))


def _recording(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt ids of every request the engine gets."""
    prompts: list[list[int]] = []
    add = engine.add_request

    def record(ids: Any, params: Any = None, request_id: Any = None) -> Any:
        prompts.append(list(ids))
        return add(ids, params, request_id)

    monkeypatch.setattr(engine, "add_request", record)
    return prompts


def _run(chat: Chat, lines: list[str]) -> str:
    out = io.StringIO()
    assert run_chat(chat, io.StringIO("".join(f"{line}\n" for line in lines)), out) == 0
    return out.getvalue()


def test_the_conversation_is_kept_until_clear(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _recording(engine, monkeypatch)
    tok = engine.tokenizer
    assert tok is not None
    chat = Chat(engine, tok, GREEDY, system="be brief")
    text = _run(chat, ["a b", "c d", "/help", "/clear", "e f", "/exit", "g h"])
    assert len(prompts) == 3  # nothing after /exit
    system = {"role": "system", "content": "be brief"}
    assert prompts[0] == tok.encode_chat([system, {"role": "user", "content": "a b"}])
    # the second prompt holds the first exchange; after /clear only the system prompt stays
    assert len(prompts[1]) > len(prompts[0]) and prompts[1][:len(prompts[0])] == prompts[0]
    assert prompts[2] == tok.encode_chat([system, {"role": "user", "content": "e f"}])
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.messages[0]["content"] == "e f"
    assert text.count(" tokens in ") == 3 and text.count("tokens/s decode") == 3  # the speed of each answer
    assert "(conversation cleared)" in text and "/clear forgets the conversation" in text
    assert engine.leak_report() == []


def test_answers_are_the_models_own_greedy_replies(engine: Engine, ckpt_a: Path) -> None:
    from infer import LLM

    tok = engine.tokenizer
    assert tok is not None
    chat = Chat(engine, tok, GREEDY)
    out = io.StringIO()
    streamed, dropped = chat.ask("a b c", out)
    want = LLM(str(ckpt_a), device="cpu", max_seq_len=96).chat([{"role": "user", "content": "a b c"}], GREEDY)
    assert streamed.text == out.getvalue() == want[0].outputs[0].text and dropped == 0
    assert streamed.num_tokens == len(want[0].outputs[0].token_ids) and streamed.first is not None


def test_a_long_conversation_drops_its_oldest_exchanges(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _recording(engine, monkeypatch)
    tok = engine.tokenizer
    assert tok is not None
    chat = Chat(engine, tok, GREEDY)
    words = " ".join(["a b c d"] * 5)
    text = _run(chat, [words] * 4 + [" ".join(["e f g h"] * 40), "i j"])
    assert all(len(p) < 96 for p in prompts) and "oldest exchange(s) dropped to fit the context" in text
    assert "error: this message makes a prompt of" in text and "--max-seq-len raises it" in text
    assert prompts[-1] != tok.encode_chat([{"role": "user", "content": "i j"}])  # the chat went on, history kept
    assert engine.leak_report() == []


def test_a_model_without_a_chat_template_gets_a_transcript(engine: Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _recording(engine, monkeypatch)
    tok = copy.copy(engine.tokenizer)
    tok.chat_template = None  # type: ignore[union-attr]
    chat = Chat(engine, tok, GREEDY, system="sys")  # type: ignore[arg-type]
    text = _run(chat, ["a b"])
    assert "no chat template" in text and TRANSCRIPT_STOP in chat.params.stop
    assert prompts == [tok.encode(transcript([{"role": "system", "content": "sys"},  # type: ignore[union-attr]
                                              {"role": "user", "content": "a b"}]))]
    assert transcript([{"role": "user", "content": "x"}]) == "User: x\nAssistant:"


def test_infer_chat_reads_stdin_until_its_end(ckpt_a: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("a b\n/unknown\nc d\n"))
    assert main(["chat", "--model", str(ckpt_a), "--device", "cpu", "--max_tokens", "3", "--system", "s"]) == 0
    out = capsys.readouterr().out
    assert out.count("[3 tokens in ") == 2 and "unknown command /unknown" in out
