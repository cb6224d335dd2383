"""The worker-process side of compiling grammars: `start` (a pool's initializer, at nice
`NICENESS`) builds the process's compiler for one tokenizer, `compile_serialized` compiles one
spec under an address-space limit (RLIMIT_AS) and returns it as xgrammar's JSON
(`Grammars.load` reads it back). docs/server.md, "Security and limits".
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence

from infer.engine import structured
from infer.sampling import StructuredOutput

NICENESS = 10


class _Process:
    """This worker process's compiler (set by `start`)."""

    compiler: structured.xgr.GrammarCompiler | None = None


def start(token_table: list[bytes], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
    os.nice(NICENESS)
    _Process.compiler = structured.new_compiler(structured.tokenizer_info(token_table, vocab_size, eos_token_ids))


def compile_serialized(spec: StructuredOutput, memory_limit: int) -> str:
    """`spec` compiled and checked (`structured.compile_checked`), as JSON; ValueError for a
    spec that is invalid or accepts no string, MemoryError past `memory_limit` more bytes."""
    assert _Process.compiler is not None, "start() runs first in a worker process"
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = _address_space()
    if size is not None:  # (Linux; elsewhere only the time limit applies)
        limit = size + memory_limit
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        compiled = structured.compile_checked(_Process.compiler, spec)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return compiled.serialize_json()


def _address_space() -> int | None:
    """This process's virtual memory size in bytes (VmSize), None where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
