"""Tool calls out of a chat completion's text: the Llama 3 JSON format, whole or streamed.

Optionally `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` (`"arguments"` read too), several separated
by `;`. `CallReader` turns a choice's text deltas into content and `CallDelta`s: under auto a possible call is held
to the end, other text streams as content; a forced call streams its name, then argument fragments.
docs/server.md, "Tool calls"."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass

from infer.tokenization.tool_prompt import CALL_SEPARATOR

PYTHON_TAG = "<|python_tag|>"
_FORCED_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                          r'"(?:parameters|arguments)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class CallDelta:
    """A piece of a streamed tool call (`index` among the message's calls): id and name come with its
    first delta; the `arguments` fragments join to the call's arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str, names: Collection[str] | None = None) -> list[ParsedCall] | None:
    """The Llama 3 JSON tool calls `text` consists of, or None when it is not only calls
    (with `names`: of those functions only)."""
    rest = text.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG):].lstrip()
    calls: list[ParsedCall] = []
    while rest:
        try:
            value, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        call = _as_call(value, names)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].lstrip()
        if rest:
            if not rest.startswith(CALL_SEPARATOR.strip()):
                return None
            rest = rest[1:].lstrip()
            if not rest:
                return None  # a separator with no call after it
    return calls or None


def _as_call(value: object, names: Collection[str] | None) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    keys = set(value) - {"name"}
    if len(keys) != 1 or not keys <= {"parameters", "arguments"}:
        return None
    arguments = value[keys.pop()]
    if not isinstance(arguments, dict) or (names is not None and value["name"] not in names):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class CallReader:
    """One choice's text in, (content delta, tool-call deltas) out, the same streamed or not."""

    def __init__(self, forced: bool, names: Collection[str], parallel: bool = True) -> None:
        self.forced = forced
        self.names = names
        self.parallel = parallel
        self.buffer = ""  # text held back (auto: a possible call; forced: the whole text)
        self.passing = False  # auto: the text is content, streamed as it comes
        self.calls: list[ParsedCall] = []  # the message's calls, complete after finish()
        self.content: str | None = None  # the message's content, complete after finish()
        self._args_start: int | None = None  # forced: where the arguments start in the buffer
        self._sent = 0  # forced: argument characters sent
        self._id = call_id()

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """A text delta in: (content to send now, call deltas to send now)."""
        if self.passing:
            self.content = (self.content or "") + text
            return text, []
        self.buffer += text
        if self.forced:
            return "", self._forced_deltas(final=False)
        head = self.buffer.lstrip()
        if not head or head[0] == "{" or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]):
            return "", []  # may be a call: held back
        self.passing, self.content = True, self.buffer
        return self.buffer, []

    def finish(self, complete: bool) -> tuple[str, list[CallDelta]]:
        """What is still to send at the end (`complete`: not cut by max_tokens)."""
        if self.passing:
            return "", []
        if self.forced:
            deltas = self._forced_deltas(final=True, complete=complete)
            if self._args_start is None:
                self.content = self.buffer
                return self.buffer, []
            return "", deltas
        calls = parse_tool_calls(self.buffer, self.names)
        if calls is None:
            self.content = self.buffer
            return self.buffer, []
        self.calls = calls if self.parallel else calls[:1]
        return "", [CallDelta(i, c.arguments, call_id(), c.name) for i, c in enumerate(self.calls)]

    def _forced_deltas(self, final: bool, complete: bool = True) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        if self._args_start is None:
            head = _FORCED_HEAD.match(self.buffer)
            if head is None:
                return []
            self._args_start = head.end()
            self.calls = [ParsedCall(json.loads(head.group(1)), "")]
            deltas.append(CallDelta(0, "", self._id, self.calls[0].name))
        if self._sent == 0:  # (white space before the arguments is not theirs)
            while self._args_start < len(self.buffer) and self.buffer[self._args_start].isspace():
                self._args_start += 1
        body = self.buffer[self._args_start:]
        end = len(body.rstrip())
        if body[:end].endswith("}") and (complete or not final):
            end -= 1  # the call's own closing brace, unless more text follows it
        if end > self._sent:
            deltas.append(CallDelta(0, body[self._sent:end]))
            self._sent = end
        if final:
            self.calls = [ParsedCall(self.calls[0].name, body[:self._sent])]
        return deltas
