"""Schemathesis over the server's own OpenAPI schema: no 5xx, no response that violates the
schema (JSON bodies and each server-sent event), invalid requests rejected with 4xx.

Runs the schemathesis CLI against a live server (tiny checkpoint, 64-token context so that
generated requests stay short) with a fixed seed and a bounded number of examples.
Needs `schemathesis` (dev dependency); skipped when it is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infer import EngineConfig
from infer.server.launch import LiveServer

pytest.importorskip("schemathesis", reason="pip install schemathesis (dev dependency)")

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection")


@pytest.fixture(scope="module")
def server(ckpt_a: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=64, max_batch_size=8)
    live = LiveServer.start(config, "tiny", max_queued_requests=64)
    yield live
    live.stop()


def test_schemathesis_finds_no_server_errors_or_schema_violations(server: LiveServer, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks", CHECKS,
           "--phases", "examples,coverage,fuzzing", "--mode", "all", "--max-examples", "30", "--seed", "20261126",
           "--workers", "1", "--request-timeout", "60", "--suppress-health-check", "all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "6 selected" in proc.stdout
    server.settle()
    assert server.leak_report() == []
    assert server.engine.healthy
