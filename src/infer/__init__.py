"""infer: LLM inference for Llama-family models with lossless speculative decoding.

    from infer import LLM, SamplingParams
    out = LLM().generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))  # LLM(): the demo model

The names below are imported on first use (PEP 562): `import infer` does not load torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.engine.config import EngineConfig
    from infer.engine.output import CompletionOutput, RequestOutput
    from infer.llm import LLM
    from infer.sampling import SamplingParams

_WHERE = {"LLM": "infer.llm", "SamplingParams": "infer.sampling", "EngineConfig": "infer.engine.config",
          "RequestOutput": "infer.engine.output", "CompletionOutput": "infer.engine.output"}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
DISTRIBUTION = "infer-engine"  # the name on PyPI (`pip install infer-engine`); the module and command are `infer`


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
