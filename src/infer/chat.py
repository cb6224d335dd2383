"""`infer chat`: an interactive conversation with a model in the terminal.

Each line typed is a user message; the answer streams, then a speed line. The conversation is rendered with the model's
chat template (else a plain "User: / Assistant:" transcript); when it outgrows `max_seq_len` its oldest exchanges are
dropped, the system prompt kept. Commands: /clear, /exit or /quit (or Ctrl-D), /help; Ctrl-C stops an answer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TextIO

from infer.sampling import SamplingParams
from infer.streaming import Streamed, rate_summary, stream_request

if TYPE_CHECKING:
    from infer.engine.engine import Engine
    from infer.tokenization import Tokenizer

Message = dict[str, str]
HELP = "/clear forgets the conversation (the system prompt stays), /exit leaves (or Ctrl-D); Ctrl-C stops an answer"
TRANSCRIPT_STOP = "\nUser:"  # where a model without a chat template is cut off in the plain transcript
PROMPT = ">>> "


def transcript(messages: Sequence[Message]) -> str:
    """The plain rendering of a conversation for a model without a chat template."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


@dataclass
class Chat:
    """A conversation with `engine`'s model: `ask` streams an answer and keeps both messages."""

    engine: Engine
    tokenizer: Tokenizer
    params: SamplingParams  # each answer's; max_tokens is cut to the room the context leaves
    system: str | None = None
    messages: list[Message] = field(default_factory=list)  # user and assistant turns, oldest first

    def __post_init__(self) -> None:
        self.templated = self.tokenizer.chat_template is not None
        if not self.templated:
            self.params = replace(self.params, stop=(*self.params.stop, TRANSCRIPT_STOP))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        turns = ([{"role": "system", "content": self.system}] if self.system else []) + list(messages)
        if self.templated:
            return self.tokenizer.encode_chat(turns)
        return self.tokenizer.encode(transcript(turns))

    def fit(self, user: str) -> tuple[list[int], int]:
        """(the prompt ids of the conversation and `user`'s message, exchanges dropped to fit
        the context); ValueError when the message alone is too long."""
        limit = self.engine.resolved.scheduler.max_seq_len
        history = list(self.messages)
        while True:
            ids = self.prompt_ids([*history, {"role": "user", "content": user}])
            if len(ids) < limit:
                return ids, (len(self.messages) - len(history)) // 2
            if not history:
                raise ValueError(f"this message makes a prompt of {len(ids)} tokens; the context holds {limit} "
                                 "(--max-seq-len raises it, up to the model's own)")
            history = history[2:]  # the oldest user message and its answer

    def ask(self, user: str, out: TextIO) -> tuple[Streamed, int]:
        """Stream the answer to `user` to `out`; (what streamed, exchanges dropped to fit)."""
        ids, dropped = self.fit(user)
        if dropped:
            self.messages = self.messages[2 * dropped:]
        room = self.engine.resolved.scheduler.max_seq_len - len(ids)
        request = self.engine.add_request(ids, replace(self.params, max_tokens=min(self.params.max_tokens, room)))
        streamed = stream_request(self.engine, request, out)
        answer = streamed.text.removesuffix(TRANSCRIPT_STOP).strip() if not self.templated else streamed.text
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return streamed, dropped

    def clear(self) -> None:
        self.messages = []


def read_line(stdin: TextIO, stdout: TextIO) -> str | None:
    """The next line typed (None at the end of input); a terminal gets the prompt and line editing."""
    if stdin is sys.stdin and stdin.isatty() and stdout is sys.stdout:
        try:
            return input(PROMPT)
        except EOFError:
            return None
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def run_chat(chat: Chat, stdin: TextIO, stdout: TextIO) -> int:
    """The conversation loop until /exit or the end of input; exit status 0."""
    note = "" if chat.templated else " (no chat template: a plain User/Assistant transcript)"
    stdout.write(f"chat with the model{note}; {HELP}\n")
    while (line := read_line(stdin, stdout)) is not None:
        text = line.strip()
        if text in ("/exit", "/quit", "/bye"):
            break
        if text in ("/clear", "/help") or not text:
            if text == "/clear":
                chat.clear()
            stdout.write(f"{'(conversation cleared) ' if text == '/clear' else ''}{HELP}\n" if text else "")
            continue
        if text.startswith("/") and " " not in text:
            stdout.write(f"unknown command {text}: {HELP}\n")
            continue
        try:
            streamed, dropped = chat.ask(text, stdout)
        except ValueError as exc:
            stdout.write(f"error: {exc}\n")
            continue
        dropped_note = f", the {dropped} oldest exchange(s) dropped to fit the context" if dropped else ""
        stopped = ", stopped" if streamed.interrupted else ""
        stdout.write("\n" + rate_summary(streamed.num_tokens, streamed.start, streamed.first, streamed.end)
                     + f"{stopped}{dropped_note}]\n")
        stdout.flush()
    return 0
