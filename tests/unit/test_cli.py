"""The `infer` command line: `--help` without torch, every flag checked before a model
loads (errors on their own line, nothing echoed), defaults shown, `bench --suite smoke`
on the demo pair by default, `bench --plot` PNG charts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infer_bench.results import BenchRun, Measurement, save_run
from infer.cli import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infer.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_imports_no_torch() -> None:
    code = ("import sys; from infer.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "from infer.cli import build_parser; build_parser(['generate']).parse_args(['generate'])\n"
            "build_parser(['serve']).parse_args(['serve'])\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "generate" in out.stdout and "serve" in out.stdout and "bench" in out.stdout


@pytest.mark.parametrize("flags, says", [
    (["--max-tokens", "-1"], "max_tokens"), (["--temperature", "-1"], "temperature"),
    (["--presence-penalty", "3"], "presence_penalty"), (["--threads", "0"], "threads"),
    (["--prompt", "word " * 2000], "--max-seq-len"),
])
def test_generate_checks_flags_before_loading(flags: list[str], says: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import infer.engine.engine as engine_module

    def no_load(*_: Any, **__: Any) -> Any:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(engine_module, "Engine", no_load)
    assert main(["generate", "--device", "cpu", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing echoed: the error is not glued to the prompt
    assert err.startswith("error: ") and says in err


def test_generate_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("default: 0.0; SamplingParams' default is 1.0", "default: 128; SamplingParams' default is 16",
                     "--threads", "--max-batch-size", "at most 256), 8 on a CPU", "--system", "--stop TEXT",
                     "'-' to read it from stdin", "default: the model's own context"):
        assert expected in text


def test_serve_help_lists_security_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--api-key", "--allowed-hosts", "--max-request-bytes", "--allow-special-tokens",
                 "--shutdown-timeout", "--public-metrics", "--threads"):
        assert flag in text


def test_generate_runs_on_the_demo_model() -> None:
    out = run_cli("generate", "--device", "cpu", "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):") and "4 tokens" in out.stdout and "CPU thread" in out.stdout


def test_bench_smoke_defaults_to_the_demo_pair(tmp_path: Path) -> None:
    from infer_bench.cli import run_bench
    from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET

    out = tmp_path / "smoke.json"
    args = build_parser(["bench"]).parse_args(["bench", "--suite", "smoke", "--device", "cpu", "--output-len", "3",
                                               "--warmup-tokens", "1", "--cost-repeats", "1", "--repeats", "1",
                                               "--no-hf", "--out", str(out)])
    assert run_bench(args) == 0
    from infer_bench.results import load_run
    run = load_run(out)
    plain = run.get("smoke/plain")
    assert plain is not None and plain.ok and plain.params["engine"]["model"] == str(DEMO_TARGET)
    assert run.get("smoke/spec-k4").params["engine"]["draft_model"] == str(DEMO_DRAFT)


def test_bench_plot_writes_png_charts(tmp_path: Path) -> None:
    run = BenchRun("demo", environment={"device": "cpu"})
    for name, rate in (("g/plain", 100.0), ("g/spec", 150.0)):
        m = Measurement(name, "engine", "group one", metrics={"primary_rate": rate})
        run.add(m)
    run.get("g/spec").derived["speedup"] = 1.5  # type: ignore[union-attr]
    run.add(Measurement("g/failed", "engine", "group one", status="error", error="boom"))
    path = tmp_path / "r.json"
    save_run(run, path)
    assert main(["bench", "--plot", str(path)]) == 0
    charts = sorted((tmp_path / "r-charts").iterdir())
    assert [c.name for c in charts] == ["group-one.png"]
    assert charts[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and charts[0].stat().st_size > 5000


def test_auto_threads_follow_model_size() -> None:
    from infer.engine.threads import auto_threads

    assert auto_threads(14_000_000, 2) == 1 and auto_threads(14_000_000, 64) == 1  # small: one thread
    assert auto_threads(1_200_000_000, 2) == 1  # at most half the cores
    assert auto_threads(1_200_000_000, 16) == 4
    assert auto_threads(8_000_000_000, 16) == 8


def test_engine_applies_threads(ckpt_a: Path) -> None:
    import torch

    from infer import LLM

    before = torch.get_num_threads()
    try:
        assert LLM(str(ckpt_a), device="cpu", threads=2).engine.threads == 2
        assert torch.get_num_threads() == 2
        assert LLM(str(ckpt_a), device="cpu").engine.threads == 1  # a tiny model: one thread
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_api_is_documented() -> None:
    from infer import LLM, SamplingParams

    assert "EngineConfig" in (LLM.__doc__ or "") and "threads" in (LLM.__doc__ or "")
    assert "prompt_token_ids" in (LLM.generate.__doc__ or "") and "chat template" in (LLM.chat.__doc__ or "")
    for field in ("temperature", "presence_penalty", "logprobs", "max_tokens"):
        assert field in (SamplingParams.__doc__ or "")
