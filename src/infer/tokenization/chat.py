"""Chat templates: message validation and Jinja rendering the way Hugging Face does it.

Templates are untrusted code: they run in Jinja's immutable sandbox, with the environment
`transformers` gives them, so published templates render the same text. `LLAMA3_CHAT_TEMPLATE`
serves a Llama 3 vocabulary without a template of its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infer.tokenization.tool_prompt import fold_tools

CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")
# A vocabulary with these tokens and no chat template of its own gets LLAMA3_CHAT_TEMPLATE.
LLAMA3_HEADER_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# Llama 3 instruct (tool results under the "ipython" header)
LLAMA3_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
    {%- if message['content'] is string %}
        {%- set content = message['content'] %}
    {%- else %}
        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')
                          | map(attribute='text') | join('') %}
    {%- endif %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (a training mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the `generation` tag itself
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandboxed environment with the helpers templates use."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template has a syntax error at line {exc.lineno}: "
                         f"{exc.message}; fix the model's chat template") from exc


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool, special_tokens: Mapping[str, str | None],
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         **template_kwargs: Any) -> str:
    """Validate `messages` and render them with the template `source` (tools the template does not
    render go into the messages as text: `tool_prompt.fold_tools`); ValueError on failure."""
    clean, tools = fold_tools(validate_messages(messages), tools, source)
    template = compile_chat_template(source)
    variables = {**special_tokens, **template_kwargs}
    try:
        return template.render(messages=clean, tools=None if tools is None else list(tools),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template rejected the conversation: {exc}") from exc


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check each message's role and content; return plain-dict copies without None values."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; pass at least one {'role', 'content'} message")
    return [_validate_message(i, message) for i, message in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', "
                         f"got {type(message).__name__}")
    clean = {key: value for key, value in message.items() if value is not None}
    role = clean.get("role")
    if role is None:
        raise ValueError(f"{where} has no 'role'; use one of {', '.join(CHAT_ROLES)}")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where} has unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}")
    if "content" not in clean:
        if role == "assistant" and clean.get("tool_calls"):
            return clean
        raise ValueError(f"{where} (role {role!r}) has no 'content'; add the message text")
    _check_content(where, clean["content"])
    return clean


def _check_content(where: str, content: Any) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"{where}['content'] must be a string or a list of content parts, "
                         f"got {type(content).__name__}")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ValueError(f"{where}['content'][{j}] must be a dict with a 'type' "
                             "(e.g. {'type': 'text', 'text': '...'})")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"{where}['content'][{j}] is a text part without a 'text' string")
