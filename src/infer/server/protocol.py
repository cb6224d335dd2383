"""OpenAI request schemas (pydantic) for /v1/completions and /v1/chat/completions.

Validated strictly (no "5" -> 5 coercion; integral floats accepted) with the ranges in the
schema; unimplemented parameters are declared so that setting them is a 400 naming them, unknown
fields are ignored. docs/server.md, "Endpoints".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, model_validator

from infer.sampling import MAX_LOGPROBS, MAX_PENALTY, MAX_TEMPERATURE, MAX_TOP_K, MIN_PENALTY

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_N = 128  # choices per request (OpenAI's limit)
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs` (OpenAI's limit; chat takes up to 20)
MAX_TOOLS = 128  # tools per request (OpenAI's limit)


def _valid_unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x} at character "
                             f"{exc.start}), which is not valid Unicode: send UTF-8 text") from None
    return text


def _integral(value: Any) -> Any:
    """1.0 -> 1 (JSON numbers with no fraction are integers); anything else goes on to validation."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def _whole(value: float) -> int:
    if not value.is_integer():
        raise ValueError("must be an integer")
    return int(value)


def _false(value: bool) -> bool:
    if value:
        raise ValueError("true is not a value here: send false, or an integer")
    return value


INTEGRAL = BeforeValidator(_integral)
# false and nothing else (a Literal[False] takes 0 too, as 0 == False)
OnlyFalse = Annotated[bool, AfterValidator(_false), Field(json_schema_extra={"const": False})]
Text = Annotated[str, AfterValidator(_valid_unicode)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Int = Annotated[int, INTEGRAL]
# (a nullable integer's bounds go inside its integer type, so the schema shows minimum / maximum)
# token ids: an integer, or an integral float (the union keeps lists of ints on pydantic's fast path)
TokenId = Annotated[int, Field(ge=0)] | Annotated[float, Field(ge=0, multiple_of=1), AfterValidator(_whole)]
T = TypeVar("T")
OnePrompt = Annotated[list[T], Field(min_length=1, max_length=1)]
Unsupported = JsonValue | None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="send a final chunk with token usage before [DONE]")


class SamplingFields(_Strict):
    """Parameters shared by completions and chat completions."""

    model: Text | None = Field(None, description="served model name; default: the served model")
    n: Int = Field(1, ge=1, le=MAX_N, description="independent samples of the same prompt (choices)")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        1.0, description=f"0 = greedy; at most {MAX_TEMPERATURE:g} (OpenAI's API: 2)")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(1.0, description="1 = off")
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K), INTEGRAL] | None = Field(
        -1, description="-1 or 0 = off (extension)")
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        0.0, description="subtracted once from the logit of every token already in the prompt or output")
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        0.0, description="subtracted per occurrence in the prompt or output")
    repetition_penalty: Annotated[float, Field(ge=MIN_PENALTY, le=MAX_PENALTY)] | None = Field(
        1.0, description="1 = off (extension)")
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters (not returned)")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="stop token ids (extension)")
    ignore_eos: bool = Field(False, description="keep generating after EOS (extension)")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), INTEGRAL] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # declared so that a request relying on them is refused (400) rather than silently ignored
    tools: Unsupported = Field(None, description="chat completions only (400 here)")
    tool_choice: Unsupported = Field(None, description="chat completions only (400 here unless 'none')")
    functions: Unsupported = Field(None, description="not supported (400)")
    function_call: Unsupported = Field(None, description="not supported (400 unless 'none')")
    response_format: JsonValue | None = Field(None, description="{'type': 'text' | 'json_object' | 'json_schema', "
                                              "'json_schema': {'name', 'schema', 'strict'}}")
    guided_json: JsonValue | None = Field(None, description="a JSON schema the output follows (extension, vLLM)")
    guided_regex: Text | None = Field(None, description="a regular expression the output matches (extension)")
    guided_choice: list[Text] | None = Field(None, description="the output is one of these strings (extension)")
    guided_grammar: Text | None = Field(None, description="an EBNF grammar the output follows (extension)")
    logit_bias: Unsupported = Field(None, description="not supported (400 unless empty)")
    speculation: OnlyFalse | Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None, description="speculative decoding for this request (extension): false = none (plain decoding), "
                          "K = at most K drafts a round (at most the server's spec_length); default: the "
                          "server's policy")

    refused: ClassVar[tuple[str, ...]] = ("tools", "functions")  # 400 when set
    refused_unless_none: ClassVar[tuple[str, ...]] = ("tool_choice", "function_call")  # 400 unless "none"

    def unsupported(self) -> str | None:
        """The first parameter set to something the server does not implement, else None."""
        for name in self.refused:
            if getattr(self, name) is not None:
                return name
        for name in self.refused_unless_none:
            if getattr(self, name) not in (None, "none"):
                return name
        if self.logit_bias not in (None, {}):
            return "logit_bias"
        return None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 1,
         "stop": ["."], "stream": True, "n": 2, "logprobs": 2},
    ]})

    prompt: Text | list[TokenId] | OnePrompt[Text] | OnePrompt[list[TokenId]] = Field(
        description="text or token ids (a list of prompts must hold exactly one)")
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = 16
    echo: bool = Field(False, description="return the prompt before the completion")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), INTEGRAL] | None = Field(
        None, description="log-probabilities of each token and of the N most likely")
    best_of: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] | None = Field(
        None, description="only best_of = n (400 otherwise)")
    suffix: Literal[""] | None = Field(None, description="not supported: only empty")

    def unsupported(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                                     description="letters, digits, _ and -, at most 64 (OpenAI's rule)")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, JsonValue] | None = Field(None, description="a JSON schema of an object; default: none")
    strict: bool | None = Field(None, description="accepted; required / named choices are always enforced")


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionRef


class CalledFunction(_Strict):
    name: Text
    arguments: Text = Field(description="the arguments as JSON text")


class ToolCallIn(_Strict):
    id: Text
    type: Literal["function"]
    function: CalledFunction


ToolList = Annotated[list[ToolDefinition], Field(min_length=1, max_length=MAX_TOOLS)]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant message's calls")
    tool_call_id: Text | None = Field(None, description="a tool message: the call it answers")

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: call arguments as JSON objects (else ValueError)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text(), "name": self.name,
                               "tool_call_id": self.tool_call_id}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, j)}}
                for j, c in enumerate(self.tool_calls)]
        return out


def _arguments(text: str, index: int) -> JsonValue:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool_calls[{index}].function.arguments is not valid JSON ({exc}): send the arguments "
                         "as a JSON object's text") from None
    if not isinstance(value, dict):
        raise ValueError(f"tool_calls[{index}].function.arguments must be a JSON object's text, got {text!r}")
    return value


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={
        # top_logprobs (a number) needs logprobs: true
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        "examples": [
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
         "logprobs": True, "top_logprobs": 2},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(None, description="default: the rest of "
                                                                                      "the context")
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(None,
                                                                               description="alias of max_tokens")
    logprobs: bool | None = Field(None, description="return the log-probability of each token")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = Field(
        None, description="with logprobs: also the N most likely tokens at each position")
    tools: ToolList | None = Field(  # type: ignore[assignment]
        None, description=f"functions the model may call (at most {MAX_TOOLS}); the chat template receives them")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(  # type: ignore[assignment]
        None, description="none | auto (the default with tools) | required | {'type': 'function', "
                          "'function': {'name'}}; required and named choices are enforced by a JSON schema")
    parallel_tool_calls: bool | None = Field(None, description="auto: false keeps the first call only")
    refused: ClassVar[tuple[str, ...]] = ("functions",)
    refused_unless_none: ClassVar[tuple[str, ...]] = ("function_call",)
