"""Whether a path names a GGUF file, without importing the `gguf` library."""

from __future__ import annotations

import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file to load as GGUF: named *.gguf, or starting with the magic."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
