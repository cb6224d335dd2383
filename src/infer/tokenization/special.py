"""Chat prompts whose user text cannot smuggle in control tokens.

Special-token strings inside messages are swapped for unique markers before the template runs; the rendered text is
cut at the template's own special tokens (their ids), and the text between, markers restored, is encoded with
special-token parsing off. Messages without special strings encode exactly as with plain parsing.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Encode = Callable[[str], list[int]]  # text -> ids, special-token strings as plain text


def special_pattern(specials: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any of the special-token strings, longest first (None: there are none)."""
    ordered = sorted({s for s in specials if s}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _fresh_marker(texts: Sequence[str]) -> str:
    while True:  # a private-use frame around random hex: collides with nothing in practice, checked anyway
        marker = f"\ue000{secrets.token_hex(8)}"
        if not any(marker in t for t in texts):
            return marker


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _escape(value: Any, pattern: re.Pattern[str], marker: str, index: dict[str, int]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: f"{marker}{index[m.group(0)]}\ue001", value)
    if isinstance(value, Mapping):
        return {k: _escape(v, pattern, marker, index) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape(v, pattern, marker, index) for v in value]
    return value


def escape_messages(messages: Sequence[Mapping[str, Any]], pattern: re.Pattern[str],
                    specials: Sequence[str]) -> tuple[list[Any], Callable[[str], str]]:
    """(messages with every special string replaced by a marker, a function restoring them in text)."""
    marker = _fresh_marker(_strings(list(messages)))
    index = {s: i for i, s in enumerate(specials)}
    escaped = [_escape(m, pattern, marker, index) for m in messages]
    back = re.compile(re.escape(marker) + r"(\d+)\ue001")
    return escaped, lambda text: back.sub(lambda m: specials[int(m.group(1))], text)


def encode_rendered(text: str, pattern: re.Pattern[str], token_id: Callable[[str], int | None],
                    encode_plain: Encode, restore: Callable[[str], str]) -> list[int]:
    """Ids of rendered chat text: special-token strings as their ids, the rest (restored) as plain text."""
    ids: list[int] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            ids += encode_plain(restore(text[pos:match.start()]))
        special = token_id(match.group(0))
        assert special is not None, match.group(0)
        ids.append(special)
        pos = match.end()
    if pos < len(text):
        ids += encode_plain(restore(text[pos:]))
    return ids
