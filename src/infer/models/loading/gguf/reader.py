"""Open a GGUF file: check that it is whole and holds a model infer runs, read metadata and tensors.

`GGUFFile.open(path)` reads the header from the file's memory map (header.py); tensor data is
read only when used. A bad file (not GGUF, truncated, unsupported architecture, mixture of
experts, missing metadata) raises an error that says what to fix.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from infer.models.loading.gguf.header import HeaderField, TensorEntry, map_file, read_header, release
from infer.models.loading.gguf.path import GGUF_MAGIC

__all__ = ["GGUFFile", "GGUFTensor"]

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values infer loads
GGUFTensor = TensorEntry  # one tensor as stored: ggml type, torch-order shape, memory-mapped data


class GGUFFile:
    """A validated GGUF file of a supported dense decoder: metadata lookups and the tensor table."""

    def __init__(self, path: Path, mapped: mmap.mmap, fields: dict[str, HeaderField],
                 tensors: list[GGUFTensor]) -> None:
        self.path = path
        self._mapped = mapped
        self._fields = fields
        self.architecture: str = self.value("general.architecture")
        self.tensors: dict[str, GGUFTensor] = {t.name: t for t in tensors}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Open and validate `path`; raises ValueError / FileNotFoundError saying what to fix."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes "
                             "'GGUF'); pass a llama.cpp .gguf model file or a Hugging Face model directory")
        try:
            mapped = map_file(path)
            fields, tensors = read_header(mapped)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
            # a file cut short fails here, in its header or at the first tensor past the end
            raise ValueError(
                f"GGUF file {str(path)!r} ({size} bytes) is truncated or corrupt ({type(exc).__name__}: "
                f"{exc}); an interrupted download leaves such a file: download it again") from exc
        gguf = cls(path, mapped, fields, tensors)
        gguf._check_architecture()
        return gguf

    def release(self, data: np.ndarray) -> None:
        """Drop the resident pages of `data` (a tensor's, read): see gguf/header.py `release`."""
        release(self._mapped, data)

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key` (str, int, float, bool or list), or `default`."""
        field = self._fields.get(key)
        return default if field is None else field.value()

    def value(self, key: str) -> Any:
        """The metadata value of `key`; a clear error when the file lacks it."""
        if key not in self._fields:
            raise ValueError(f"GGUF file {str(self.path)!r} lacks the metadata key {key!r}; the "
                             "file is incomplete or was written by an unusual converter: re-convert it "
                             "with llama.cpp's convert_hf_to_gguf.py")
        return self._fields[key].value()

    def arch_value(self, suffix: str) -> Any:
        """`<architecture>.<suffix>` (e.g. `llama.block_count`); an error when absent."""
        return self.value(f"{self.architecture}.{suffix}")

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`<architecture>.<suffix>`, or `default` when the file lacks it."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def _check_architecture(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"GGUF file {str(self.path)!r} holds a {self.architecture!r} model; infer runs the "
                f"architectures {', '.join(ARCHITECTURES)} (general.architecture; Mistral files are 'llama')")
        experts = self.arch_get("expert_count", 0)
        if experts:
            raise ValueError(
                f"GGUF file {str(self.path)!r} is a mixture-of-experts model ({experts} experts, "
                "e.g. Mixtral); infer runs dense models only")
