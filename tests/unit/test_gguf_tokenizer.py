"""Tokenizers rebuilt from GGUF metadata: byte-level BPE ids equal transformers' GGUF
tokenizer (and the checkpoint's own tokenizer.json for the GPT-2 split), SentencePiece ids
equal the sentencepiece library's, special ids, stop ids and the chat template come from
the file, and a pre-tokenizer infer cannot reproduce is an error that names the workaround and
comes before any weight is read. (Each pre-tokenizer on its own: test_gguf_pretokenizers.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import TokenType

from helpers.checkpoints import CHAT_TEMPLATE, copy_checkpoint, encode, make_checkpoint
from helpers.gguf_files import SPM_USER_TOKEN, SpmVocab, spm_vocab, write_gguf
from infer.engine.loading import load_tokenizer
from infer.tokenization import Tokenizer
from infer.tokenization.chat import LLAMA3_CHAT_TEMPLATE
from infer.tokenization.gguf import byte_level_bpe
from infer.tokenization.chat import LLAMA3_HEADER_TOKENS

MIXED = ("<s>Hello world!</s> def f(x):\n    return x**2  # ünïcödé 日本語 🦙\n\n\tTabs  and   "
         "spaces 12345 don't I'll\r\nWhat?</s>world  ")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 世界! 🦙"}]


def _transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf_tok")  # no tokenizer.json beside the files


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory, gguf_dir: Path) -> tuple[Path, SpmVocab, Any]:
    vocab, processor = spm_vocab()
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt_spm"), variant="b", vocab_size=len(vocab.tokens))
    path = write_gguf(ckpt, gguf_dir / "spm.gguf", Q.Q8_0, tokenizer="llama", spm=vocab)
    return path, vocab, processor


# --- byte-level BPE -------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["a", "b"])
@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2"])
def test_byte_level_ids_match_transformers(request: pytest.FixtureRequest, gguf_dir: Path, variant: str,
                                           pre: str) -> None:
    ckpt: Path = request.getfixturevalue(f"ckpt_{variant}")
    path = write_gguf(ckpt, gguf_dir / f"{variant}-{pre}.gguf", Q.Q4_0, pre=pre)
    ours, theirs = load_tokenizer(str(path)), _transformers_tokenizer(path)
    assert ours is not None
    for special in (True, False):
        ids = ours.encode(MIXED, add_special_tokens=special)
        assert ids == theirs.encode(MIXED, add_special_tokens=special)
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.encode("x")[0] == ours.bos_token_id == theirs.bos_token_id  # BOS from the file
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    assert ours.decode(ours.encode(MIXED, add_special_tokens=False)) == MIXED
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_gpt2_split_matches_the_checkpoints_own_tokenizer(ckpt_b: Path, gguf_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(write_gguf(ckpt_b, gguf_dir / "b-gpt2.gguf", Q.F16, pre="gpt-2"))
    assert ours.encode(MIXED) == encode(ckpt_b, MIXED)  # tokenizer.json: ByteLevel's GPT-2 regex


@pytest.mark.parametrize("pre, text, pieces", [
    ("llama-bpe", "12345", ["123", "4", "5"]), ("gpt-2", "12345", ["12345"]),  # digits in threes
    ("llama-bpe", "abc", ["abc"]), ("gpt-2", "abc", ["ab", "c"]),  # whole words before merges
])
def test_pre_tokenizer_decides_the_split(pre: str, text: str, pieces: list[str]) -> None:
    """Llama 3 splits digit runs into groups of three and looks a whole word up in the
    vocabulary before merging (`ignore_merges`); GPT-2 does neither."""
    alphabet = [chr(c) for c in range(33, 127)]
    tokens = [*alphabet, "12", "123", "1234", "12345", "ab", "abc"]
    merges = ["1 2", "12 3", "123 4", "1234 5", "a b"]  # "abc" has no merge that makes it
    tok = byte_level_bpe(tokens, [TokenType.NORMAL] * len(tokens), merges, pre)
    assert tok.encode(text).tokens == pieces


def test_stop_ids_include_eot_and_eom(ckpt_b: Path, gguf_dir: Path) -> None:
    def edit(writer: Any) -> None:
        writer.add_eot_token_id(5)
        writer.add_eom_token_id(7)

    tok = Tokenizer.from_pretrained(write_gguf(ckpt_b, gguf_dir / "b-eot.gguf", Q.F16, edit=edit))
    assert tok.eos_token_ids == (1, 5, 7)


def test_llama3_chat_template_when_the_file_has_none(ckpt_b: Path, gguf_dir: Path, tmp_path: Path) -> None:
    import tokenizers

    ckpt = copy_checkpoint(ckpt_b, tmp_path / "llama3-headers")
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.add_special_tokens(list(LLAMA3_HEADER_TOKENS))
    tok.save(str(ckpt / "tokenizer.json"))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "vocab_size": tok.get_vocab_size()}))
    plain = Tokenizer.from_pretrained(write_gguf(ckpt_b, gguf_dir / "b-none.gguf", Q.F16, chat_template=None))
    headed = Tokenizer.from_pretrained(write_gguf(ckpt, gguf_dir / "b-hdr.gguf", Q.F16, chat_template=None))
    assert plain.chat_template is None and headed.chat_template == LLAMA3_CHAT_TEMPLATE
    assert headed.apply_chat_template(MESSAGES).count("<|start_header_id|>") == 3


@pytest.mark.parametrize("pre, words", [("superbpe", "names the pre-tokenizer 'superbpe'"),
                                        (None, "does not name its pre-tokenizer")])
def test_unknown_pre_tokenizer_is_an_error_naming_the_workaround(ckpt_b: Path, gguf_dir: Path, pre: str | None,
                                                                 words: str) -> None:
    path = write_gguf(ckpt_b, gguf_dir / f"b-pre-{pre}.gguf", Q.F16, pre=pre)
    with pytest.raises(ValueError, match=words) as error:
        load_tokenizer(str(path))
    message = str(error.value)
    assert "--tokenizer DIR" in message and "tokenizer=DIR" in message
    assert ("convert the model again" in message) is (pre is None)  # a recent file is not sent back to llama.cpp


def _spoil_tensor_data(path: Path) -> Path:
    """Overwrite the file's last bytes (tensor data) with 0xFF: NaN and garbage blocks."""
    data = bytearray(path.read_bytes())
    data[-4096:] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    return path


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading or building any weight fails the test."""
    import infer.models.loading.gguf.weights as gguf_weights
    import infer.models.loading.loader as loader

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a weight was read")

    monkeypatch.setattr(gguf_weights, "dequantize_tensor", refuse)
    monkeypatch.setattr(loader, "build_model", refuse)


@pytest.mark.usefixtures("no_weights")
def test_a_bad_tokenizer_fails_before_any_weight_is_read(ckpt_b: Path, gguf_dir: Path) -> None:
    from infer import LLM

    bad = _spoil_tensor_data(write_gguf(ckpt_b, gguf_dir / "b-bad-pre.gguf", Q.Q8_0, pre="superbpe"))
    with pytest.raises(ValueError, match="pre-tokenizer 'superbpe'"):
        LLM(str(bad), device="cpu")
    good = _spoil_tensor_data(write_gguf(ckpt_b, gguf_dir / "b-good-pre.gguf", Q.Q8_0, pre="qwen2"))
    with pytest.raises(AssertionError, match="a weight was read"):  # the same path does reach the weights
        LLM(str(good), device="cpu")


def test_a_bad_tokenizer_fails_before_tensor_parallel_ranks_start(ckpt_b: Path, gguf_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # worker ranks read weights as soon as they start: the check comes before them
    import infer.engine.engine as engine_module
    from infer import LLM

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("tensor-parallel ranks were started")

    monkeypatch.setattr(engine_module, "start_parallel", refuse)
    bad = write_gguf(ckpt_b, gguf_dir / "b-bad-pre-tp.gguf", Q.F16, pre="superbpe")
    with pytest.raises(ValueError, match="pre-tokenizer 'superbpe'"):
        LLM(str(bad), device="cpu", tensor_parallel_size=2)
    good = write_gguf(ckpt_b, gguf_dir / "b-good-pre-tp.gguf", Q.F16, pre="qwen2")
    with pytest.raises(AssertionError, match="ranks were started"):  # the same path does reach them
        LLM(str(good), device="cpu", tensor_parallel_size=2)


# --- SentencePiece --------------------------------------------------------------------


def test_sentencepiece_ids_match_sentencepiece(spm: tuple[Path, SpmVocab, Any]) -> None:
    path, vocab, processor = spm
    tok = Tokenizer.from_pretrained(path)
    text = MIXED.replace("<s>", "").replace("</s>", " ")
    for sample in (text, " leading space", "x", "verify  in a single pass; 42 ü"):
        assert tok.encode(sample) == [1, *processor.encode(sample)]
        decoded = tok.decode(tok.encode(sample), skip_special_tokens=True)
        assert decoded == processor.decode(processor.encode(sample))
    assert vocab.tokens[tok.bos_token_id] == "<s>" and tok.eos_token_ids == (2,)


def test_sentencepiece_text_after_special_tokens_gets_a_space_prefix(spm: tuple[Path, SpmVocab, Any]) -> None:
    """llama.cpp encodes each run of text between special tokens on its own, with
    SentencePiece's dummy space prefix."""
    path, _, processor = spm
    tok = Tokenizer.from_pretrained(path)
    expected = [1, *processor.encode("Hello world!"), 2, *processor.encode(" def f(x):"), 2]
    assert tok.encode("Hello world!</s> def f(x):</s>") == expected
    user = tok.token_to_id(SPM_USER_TOKEN)
    assert tok.encode(f"a{SPM_USER_TOKEN}b", add_special_tokens=False) == [
        *processor.encode("a"), user, *processor.encode("b")]


def test_sentencepiece_matches_transformers_on_plain_text(spm: tuple[Path, SpmVocab, Any]) -> None:
    path, _, _ = spm
    ours, theirs = Tokenizer.from_pretrained(path), _transformers_tokenizer(path)
    plain = MIXED.replace("<s>", "").replace("</s>", "\n")  # no special tokens: one run of text
    assert ours.encode(plain) == theirs.encode(plain)
    assert ours.decode(ours.encode(plain)) == theirs.decode(theirs.encode(plain))
