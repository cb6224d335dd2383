"""What a new user meets in the first hour: the distribution's name in every hint, the
server's extra, checks before anything loads (model paths, the port, flags that need
--speculative-decoding), flag choices and flag-named errors, `--version`, the decode rate
of `infer generate`, and the library's `n`, `close()` and docstrings."""

from __future__ import annotations

import socket
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import infer
from infer.cli import _summary, build_parser, main

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
    (["--draft-model", "/nonexistent"], "--draft-model needs --speculative-decoding"),
    (["--speculative-method", "ngram"], "--speculative-method needs --speculative-decoding"),
    (["--speculative-method", "draft_model"], "--speculative-method needs --speculative-decoding"),  # the default
    (["--speculative-decoding", "--draft-model", "/nonexistent"], "--draft-model: model directory '/nonexistent'"),
    (["--model", "/nonexistent"], "--model: model directory '/nonexistent'"),
    (["--speculative-decoding", "--spec-tree", "2,1", "--spec-policy", "adaptive"], "--spec-policy fixed"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
])
def test_engine_flags_are_checked_before_loading_and_errors_name_flags(
        flags: list[str], says: str, no_load: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err, err
    assert "use_speculative_decoding" not in err and "spec_policy" not in err


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
    assert "--use-cuda-graphs capture decode" in text
    assert "--speculative-decoding speculative decoding:" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"infer {infer.__version__} (infer-engine)"


def test_generate_rate_counts_decode_only() -> None:
    # 8 tokens: the first after a 3 s prefill, the other 7 in the next 0.7 s
    text = _summary(8, start=0.0, first=3.0, end=3.7)
    assert "(prefill 3.00 s)" in text and "10.0 tokens/s decode" in text
    assert "tokens/s" not in _summary(1, start=0.0, first=3.0, end=3.0)


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
