"""infer: LLM inference for Llama-family models with lossless speculative decoding.

    from infer import LLM, SamplingParams
    llm = LLM()                      # the bundled demo model; or LLM(model="path-or-hub-id")
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))
"""

from infer.engine.config import EngineConfig
from infer.llm import LLM
from infer.engine.output import CompletionOutput, RequestOutput
from infer.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
