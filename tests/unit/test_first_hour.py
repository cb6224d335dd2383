"""What a new user meets in the first hour: the distribution's name in every hint, the
server's extra, checks before anything loads (model paths, the port, speculation flags that
imply --speculative-decoding), flag choices and flag-named errors, underscore spellings,
one-line errors, `--prompt -`, `--version`, the decode rate of `infer generate`, and the
library's `n`, `close()` and docstrings."""

from __future__ import annotations

import socket
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import infer
from infer.cli import build_parser, main
from infer.streaming import rate_summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.engine.engine as engine_module

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr(engine_module, "Engine", refuse)


def test_the_distribution_name_is_the_one_in_pyproject_and_the_server_extra_has_httpx() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == infer.DISTRIBUTION == "infer-engine"
    assert project["scripts"] == {"infer": "infer.cli:main"}
    assert any(dep.startswith("httpx") for dep in project["optional-dependencies"]["server"])
    # xgrammar (and through it triton, about 1 GB on a CPU install) comes with structured outputs only
    extras = project["optional-dependencies"]
    assert not any(dep.startswith("xgrammar") for dep in extras["server"])
    assert any(dep.startswith("xgrammar") for dep in extras["structured"])
    assert infer.DISTRIBUTION in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("entry", ["infer serve", "python -m infer.server"])
def test_missing_server_extra_names_the_distribution(entry: str, monkeypatch: pytest.MonkeyPatch,
                                                     no_load: None) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    with pytest.raises(SystemExit) as exc:
        if entry == "infer serve":
            main(["serve", "--device", "cpu"])
        else:
            from infer.server.__main__ import main as server_main
            server_main(["--device", "cpu"])
    assert "pip install 'infer-engine[server]'" in str(exc.value.code)


@pytest.mark.parametrize("flags, says", [
    (["--draft-model", "/nonexistent"], "--draft-model: model directory '/nonexistent'"),  # (speculation implied)
    (["--no-speculative-decoding", "--speculative-method", "ngram"], "--speculative-method configures speculative"),
    (["--no-speculative-decoding", "--speculative-method", "draft_model"], "which --no-speculative-decoding turns off"),
    (["--no-speculative-decoding", "--spec-length", "3", "--ngram-max-order", "8"],
     "--spec-length, --ngram-max-order configure speculative decoding"),
    (["--speculative-decoding", "--draft-model", "/nonexistent"], "--draft-model: model directory '/nonexistent'"),
    (["--model", "/nonexistent"], "--model: model directory '/nonexistent'"),
    (["--spec-tree", "2,1", "--spec-policy", "adaptive"], "--spec-policy fixed"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--max-seq-len", "0"], "--max-seq-len must be >= 1"),
    (["--use-cuda-graphs"], "--use-cuda-graphs needs a CUDA device, but this engine runs on cpu: drop --use-cuda-graphs"),
    (["--enforce-eager", "--use-cuda-graphs"], "--enforce-eager and --use-cuda-graphs contradict"),
    (["--speculative-method", "suffix", "--spec-length", "8", "--spec-suffix-max-depth", "6"],
     "--spec-suffix-max-depth (6) must exceed --spec-length (8)"),
    (["--spec-suffix-cache-tokens", "0"], "--spec-suffix-cache-tokens apply to --speculative-method suffix"),
])
def test_engine_flags_are_checked_before_loading_and_errors_name_flags(
        flags: list[str], says: str, no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err
    assert "use_speculative_decoding" not in err and "spec_policy" not in err and "use_cuda_graphs" not in err


@pytest.mark.parametrize("flags", [["--spec-length", "3"], ["--ngram-max-order", "8"], ["--spec-tree", "2,1"],
                                   ["--speculative-method", "draft_model"], ["--spec-policy", "fixed"],
                                   ["--spec-disable-batch-size", "4"], ["--draft-quantization", "fp8"],
                                   ["--speculative-method", "suffix", "--spec-suffix-cache-tokens", "0"]])
def test_a_speculation_flag_turns_speculation_on(flags: list[str]) -> None:
    from infer.engine.args import engine_config_from_args

    args = build_parser(["generate"]).parse_args(["generate", "--device", "cpu", *flags])
    assert engine_config_from_args(args).use_speculative_decoding is True  # (its default value too)
    plain = build_parser(["generate"]).parse_args(["generate", "--device", "cpu"])
    assert engine_config_from_args(plain).use_speculative_decoding is False


def test_enforce_eager_and_the_underscore_spellings(no_load: None) -> None:
    from infer.engine.args import dash_flags, engine_config_from_args

    argv = dash_flags(["generate", "--max_tokens", "8", "--spec_length=3", "--stop=a_b", "--", "--x_y"])
    assert argv == ["generate", "--max-tokens", "8", "--spec-length=3", "--stop=a_b", "--", "--x_y"]
    args = build_parser(argv).parse_args(dash_flags(["generate", "--max_tokens", "8", "--enforce_eager",
                                                     "--device", "cpu"]))
    assert args.max_tokens == 8
    assert engine_config_from_args(args).use_cuda_graphs is False


@pytest.mark.parametrize("argv, says", [
    (["generate", "--temperature", "abc"], "infer generate: error: argument --temperature: invalid float value: 'abc'"),
    (["generate", "--max-tokenz", "8"], "infer generate: error: unrecognized arguments: --max-tokenz 8"),
    (["serve", "--port", "99999"], "infer serve: error: argument --port: a TCP port is 1..65535, got '99999'"),
    (["serve", "--port", "-5"], "infer serve: error: argument --port: a TCP port is 1..65535, got '-5'"),
])
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], says: str, no_load: None,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith(says), err  # one line, no usage
    assert "--host" not in err and f"`infer {argv[0]} --help`" in err


def test_prompt_dash_reads_stdin(ckpt_a: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("a b c from stdin"))
    assert main(["generate", "--model", str(ckpt_a), "--device", "cpu", "--prompt", "-", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("a b c from stdin")


def test_a_port_in_use_fails_before_loading(no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "serving" not in err


def test_string_flags_show_their_choices_and_booleans_their_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["generate"]).parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, choice in (("--dtype", "bfloat16"), ("--quantization", "fp8"), ("--speculative-method", "ngram"),
                         ("--spec-policy", "adaptive"), ("--batching-mode", "static"),
                         ("--kv-cache-backend", "contiguous")):
        assert f"{flag} {{" in text and choice in text, flag
    assert "--use-cuda-graphs, --no-use-cuda-graphs capture decode" in text and "--enforce-eager vLLM's name" in text
    assert "--no-speculative-decoding speculative decoding:" in text
    assert "default: the model's own context, capped by what the KV memory holds" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"infer {infer.__version__} (infer-engine)"


def test_generate_rate_counts_decode_only() -> None:
    # 8 tokens: the first after a 3 s prefill, the other 7 in the next 0.7 s
    text = rate_summary(8, start=0.0, first=3.0, end=3.7)
    assert "(prefill 3.00 s)" in text and "10.0 tokens/s decode" in text
    assert "tokens/s" not in rate_summary(1, start=0.0, first=3.0, end=3.0)


def test_sampling_params_n() -> None:
    from infer import SamplingParams
    assert SamplingParams(n=3).n == 3
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="^n must be"):
            SamplingParams(n=bad)


def test_docstrings_document_the_config_and_gguf() -> None:
    from infer import LLM, EngineConfig
    assert EngineConfig.__doc__ and "use_speculative_decoding" in EngineConfig.__doc__
    assert ".gguf" in (LLM.__doc__ or "")


def test_llm_generates_n_samples_and_refuses_after_close(ckpt_a: Path) -> None:
    from infer import LLM, SamplingParams
    with LLM(model=str(ckpt_a), device="cpu") as llm:
        outs = llm.generate(["a b c", "d e"], SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=7))
        assert [len(o.outputs) for o in outs] == [3, 3]
        assert [c.index for c in outs[0].outputs] == [0, 1, 2]
        single = llm.generate("a b c", SamplingParams(temperature=1.0, max_tokens=4, seed=7))
        assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # sample 0 keeps the seed
        assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # the others are seeded apart
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("a b c")
    with pytest.raises(RuntimeError, match="closed"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("missing, flags", [("httpx", []), ("uvicorn", []), ("httpx", ["--url", "http://127.0.0.1:9"])])
def test_the_serve_suite_without_the_server_extra_fails_before_running(
        missing: str, flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # not importable
    out = tmp_path / "serve.json"
    assert main(["bench", "--suite", "serve", "--device", "cpu", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --suite serve needs {missing}") and "pip install 'infer-engine[server]'" in err
    assert not out.exists()


def test_over_length_errors_name_the_flag_that_raises_the_limit(ckpt_a: Path) -> None:
    import httpx

    from infer import LLM, SamplingParams
    from infer.engine.config import EngineConfig
    from infer.server.launch import LiveServer

    llm = LLM(str(ckpt_a), device="cpu", max_seq_len=32)
    with pytest.raises(ValueError, match=r"raise max_seq_len \(--max-seq-len\), up to the model's context of 512"):
        llm.generate(prompt_token_ids=[[5] * 30], sampling_params=SamplingParams(max_tokens=8))
    with LiveServer.start(EngineConfig(model=str(ckpt_a), device="cpu", max_seq_len=32), "m") as live:
        messages = [{"role": "user", "content": "a b c d e f g h " * 8}]
        for body in ({"model": "m", "messages": messages}, {"model": "m", "messages": messages[:1], "max_tokens": 4},
                     {"model": "m", "prompt": "a b " * 20, "max_tokens": 4}):
            route = "chat/completions" if "messages" in body else "completions"
            r = httpx.post(f"{live.url}/v1/{route}", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "operator can raise max_seq_len (--max-seq-len), up to the model's context of 512" in \
                r.json()["error"]["message"]
        live.settle()
        assert live.leak_report() == []
