"""Triton kernels under the interpreter, on the CPU, for the `*_interpreted` tests.

The interpreter (`TRITON_INTERPRET=1`) must be on before triton.language is first imported,
and the test process has imported it already; so a test module's `run_interpreted_cases()`
runs in a fresh Python process and its outputs come back through a file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]


def interpreted_outputs(module: str) -> dict[str, torch.Tensor]:
    """`module.run_interpreted_cases()` (a test module of tests/unit, by name) run under the
    interpreter in a subprocess; skips without triton."""
    pytest.importorskip("triton")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "outputs.pt"
        script = f"import sys, torch, {module} as t; torch.save(t.run_interpreted_cases(), sys.argv[1])"
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
            [str(TESTS.parent / "src"), str(TESTS.parent / "scripts"), str(TESTS / "unit"), str(TESTS),
             os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(path)
