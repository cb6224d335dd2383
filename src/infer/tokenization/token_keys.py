"""What each token id stands for, comparable across tokenizers: its bytes, or a special's name.

A text token's key is its bytes ("Ġthe" and "▁the" both b" the"), a special token's its name (a
str, never equal to text), so tokenizers agree where keys match. A vocabulary's form comes from
its decoder (`backends.decoder_form`); an unknown form has no text keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence

from infer.tokenization.backends import METASPACE, byte_level_bytes

TokenKey = bytes | str  # a text token's bytes; a special token's name
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def metaspace_bytes(token: str) -> bytes:
    """The bytes of a SentencePiece vocabulary string ("▁the" -> b" the", "<0x41>" -> b"A")."""
    match = _BYTE_TOKEN.fullmatch(token)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    return token.replace(METASPACE, " ").encode("utf-8")


FORMS: dict[str, Callable[[str], bytes | None]] = {"byte_level": byte_level_bytes, "metaspace": metaspace_bytes}


def vocabulary_keys(strings: Sequence[str | None], special: Collection[int], added: Mapping[int, str],
                    form: str | None) -> list[TokenKey | None]:
    """Each id's key: a special token's name, an added token's text as UTF-8, else the string's bytes
    by `form`; None for an id without a string or of an unknown form."""
    to_bytes = FORMS.get(form) if form is not None else None
    keys: list[TokenKey | None] = []
    for token_id, token in enumerate(strings):
        if token is None:
            keys.append(None)
        elif token_id in special:
            keys.append(token)
        elif token_id in added:
            keys.append(added[token_id].encode("utf-8"))
        else:
            keys.append(None if to_bytes is None else to_bytes(token))
    return keys
