"""Find and read the tokenizer files of a local model directory (Hugging Face layout).

A directory holds `tokenizer.json` or a Llama 3 tiktoken `tokenizer.model` (top or `original/`),
with optional `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` and
`chat_template.jinja` / `chat_template.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL_CANDIDATES = ("tokenizer.model", "original/tokenizer.model")
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """What a model directory offers for tokenization; exactly one backend file is set."""

    directory: Path
    tokenizer_json: Path | None
    tiktoken_model: Path | None
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    special_tokens_map: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if (self.tokenizer_json is None) == (self.tiktoken_model is None):
            raise ValueError("TokenizerFiles needs exactly one of tokenizer_json / tiktoken_model")


def locate_tokenizer_files(path: str | Path) -> TokenizerFiles:
    """Resolve `path` (a model directory) into its tokenizer files and parsed configs."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(path)!r} does not exist or is not a directory; "
            "pass a local model directory in Hugging Face layout (download it first)")
    tokenizer_json = directory / TOKENIZER_JSON
    tiktoken_model = next((directory / name for name in TIKTOKEN_MODEL_CANDIDATES
                           if (directory / name).is_file()), None)
    if not tokenizer_json.is_file() and tiktoken_model is None:
        looked_for = ", ".join((TOKENIZER_JSON, *TIKTOKEN_MODEL_CANDIDATES))
        raise FileNotFoundError(
            f"no tokenizer file in {str(directory)!r}: looked for {looked_for}; "
            "add the model's tokenizer.json (or Llama 3 tiktoken tokenizer.model)")
    tokenizer_config = read_json_object(directory / TOKENIZER_CONFIG)
    return TokenizerFiles(
        directory=directory,
        tokenizer_json=tokenizer_json if tokenizer_json.is_file() else None,
        tiktoken_model=None if tokenizer_json.is_file() else tiktoken_model,
        tokenizer_config=tokenizer_config,
        special_tokens_map=read_json_object(directory / SPECIAL_TOKENS_MAP),
        generation_config=read_json_object(directory / GENERATION_CONFIG),
        chat_template=_read_chat_template(directory, tokenizer_config),
    )


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object stored at `path`; {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove the file") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _read_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja > chat_template.json > tokenizer_config."""
    jinja_file = directory / CHAT_TEMPLATE_JINJA
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = read_json_object(directory / CHAT_TEMPLATE_JSON)
    if "chat_template" in json_file:
        return select_chat_template(json_file["chat_template"], directory / CHAT_TEMPLATE_JSON)
    if "chat_template" in tokenizer_config:
        return select_chat_template(tokenizer_config["chat_template"],
                                    directory / TOKENIZER_CONFIG)
    return None


def select_chat_template(value: Any, source: Path) -> str | None:
    """A template given as a string, or the "default" entry of a [{name, template}] list."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value
                 if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{source}: chat_template list has no entry named 'default'; "
                         f"found {sorted(str(name) for name in named)}")
    raise ValueError(f"{source}: chat_template must be a string or a list of "
                     f"{{name, template}} objects, found {type(value).__name__}")


def token_content(entry: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or {"content": ...}."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ValueError(f"tokenizer_config.json: special token entry {entry!r} must be a string "
                     "or an object with a 'content' string")


def id_list(value: Any, key: str) -> list[int]:
    """An id or list of ids from generation_config.json (`None` -> [])."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"generation_config.json: {key} must be an int or a list of ints, "
                         f"found {value!r}")
    return list(values)
