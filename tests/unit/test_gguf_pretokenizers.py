"""Every GGUF pre-tokenizer infer implements encodes a mixed corpus to the ids of an
independent reference, cuts text as llama.cpp's definitions say, and keeps its BOS and
whole-word rules; `infer generate` runs a GGUF file that names SmolLM's pre-tokenizer.

The vocabulary (helpers.mixed_vocab) was trained without any pre-tokenizer, so its merges
cross every kind of boundary and any wrong cut changes the ids. References:
- transformers' GGUF tokenizer conversion for the names it knows (and GPT-2's split, its
  default), with llama.cpp's whole-word rule set where transformers leaves it out;
- the model family's own tokenizer.json pipeline for StarCoder/SmolLM (the `Digits` and
  `ByteLevel` pre-tokenizers of the `tokenizers` library, not a regex);
- for the rest, the checkpoint's tokenizer.json with the split regexes set on it, plus the
  pieces of `test_pieces_follow_llama_cpp`, written by hand from llama.cpp's definitions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from tokenizers import Regex, pre_tokenizers

from helpers.gguf_files import write_gguf
from helpers.mixed_vocab import CORPUS, make_mixed_checkpoint
from infer import LLM, SamplingParams
from infer.tokenization import Tokenizer
from infer.tokenization.gguf import byte_level_bpe
from infer.tokenization.pretokenizers import PRE_TOKENIZERS

TRANSFORMERS_SPLITS = {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "midm-2.0", "lfm2", "smaug-bpe",
                       "dbrx", "tekken", "qwen2", "deepseek-r1-qwen", "megrez", "qwen35", "gpt-4o", "llama4"}
GPT2_SPLIT = {"gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "exaone4", "trillion", "granite-docling"}
STARCODER_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
TEXTS = [CORPUS, *CORPUS.splitlines(), "", " ", "\n\n", "x", "  12  ", "🦙", "<|im_start|><|im_end|>"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mixed_checkpoint(tmp_path_factory.mktemp("mixed"))


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pre_gguf")  # no tokenizer.json beside the files


def _reference(name: str, checkpoint: Path, path: Path) -> Any:
    """An encoder (`encode(text, add_special_tokens=False).ids`-like) built independently of infer."""
    if name in TRANSFORMERS_SPLITS | GPT2_SPLIT:
        from transformers import AutoTokenizer

        ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).backend_tokenizer
        if PRE_TOKENIZERS[name].ignore_merges:  # llama.cpp's whole-word rule; transformers omits it
            state = json.loads(ref.to_str())
            state["model"]["ignore_merges"] = True
            ref = tokenizers.Tokenizer.from_str(json.dumps(state))
        return ref
    ref = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    if name in STARCODER_SPLIT:  # StarCoder's and SmolLM's own tokenizer.json
        ref.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        ref.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZERS[name].splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return ref


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_ids_match_an_independent_reference(name: str, mixed: Path, gguf_dir: Path) -> None:
    path = write_gguf(mixed, gguf_dir / f"{name}.gguf", Q.F16, pre=name, add_bos=True)
    ours, ref = Tokenizer.from_pretrained(path), _reference(name, mixed, path)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (name, text)
        assert ours.decode(ids) == text
        assert ours.encode(text) == [ours.bos_token_id, *ids]
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1,)
    assert ours.is_special(ours.token_to_id("<|im_end|>"))


def test_the_cuts_differ_between_names(mixed: Path) -> None:
    """The corpus tells the splits apart: otherwise the test above would prove little."""
    vocab = tokenizers.Tokenizer.from_file(str(mixed / "tokenizer.json"))
    data = json.loads(vocab.to_str())
    tokens = sorted(data["model"]["vocab"], key=data["model"]["vocab"].__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [TokenType.CONTROL if t.startswith("<") and t.endswith(">") else TokenType.NORMAL for t in tokens]
    encodings = {tuple(byte_level_bpe(tokens, types, merges, name).encode(CORPUS).ids)
                 for name in ("llama-bpe", "qwen2", "tekken", "gpt-4o", "gpt-2", "smollm", "deepseek-llm",
                              "deepseek-coder", "falcon", "bloom", "viking", "default")}
    assert len(encodings) == 12


def _pieces(name: str, text: str) -> list[str]:
    cuts = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZERS[name].splits]
    return [piece for piece, _ in pre_tokenizers.Sequence(cuts).pre_tokenize_str(text)]


@pytest.mark.parametrize("name, text, pieces", [
    # Llama 3: digits in threes, a letter run takes one leading non-letter, contractions apart
    ("llama-bpe", "x=12345 I'LL", ["x", "=", "123", "45", " I", "'LL"]),
    # Qwen2: single digits; otherwise Llama 3's
    ("qwen2", "x=12345 I'LL", ["x", "=", "1", "2", "3", "4", "5", " I", "'LL"]),
    # tekken: a word is cut where lower case turns to upper
    ("tekken", "helloWorld ABCdef 12", ["hello", "World", " ABCdef", " ", "1", "2"]),
    # GPT-4o: tekken's words with the contraction kept on, digits in threes
    ("gpt-4o", "SHE'S helloWorld 12345", ["SHE'S", " hello", "World", " ", "123", "45"]),
    # GPT-2: one optional space before a run; digits whole
    ("gpt-2", "x=12345  I'LL", ["x", "=", "12345", " ", " I", "'", "LL"]),
    # SmolLM / StarCoder: every digit first, then GPT-2's split
    ("smollm", "x = 1234 is  ok", ["x", " =", " ", "1", "2", "3", "4", " is", " ", " ok"]),
    # DeepSeek Coder: newlines, letter runs, punctuation runs, CJK, single digits (`=` is a symbol)
    ("deepseek-coder", "int x=12;\n世界", ["int", " x", "=", "1", "2", ";", "\n", "世界"]),
    # DeepSeek LLM: its punctuation class spans ':' to '~', so it cuts ASCII letters off non-ASCII ones
    ("deepseek-llm", "Hello, Ωmega 世界 123  \n", ["Hello", ",", " Ω", "mega", " ", "世界", " ", "123", "  ", "\n"]),
    # Falcon: punctuation and symbol runs first, digits in threes
    ("falcon", "a+=12345 b", ["a", "+=", "123", "45", " b"]),
    # BLOOM: runs without spaces or sentence punctuation
    ("bloom", "Hi, there. ok 12", ["Hi", ",", " there", ".", " ok", " 12"]),
    # Viking: BLOOM's, then single digits
    ("viking", "Hi, there. ok 12", ["Hi", ",", " there", ".", " ok", " ", "1", "2"]),
    # default: punctuation runs, GPT-2's split, digit runs in threes
    ("default", "a+=12345 b", ["a", "+=", "123", "45", " b"]),
])
def test_pieces_follow_llama_cpp(name: str, text: str, pieces: list[str]) -> None:
    assert _pieces(name, text) == pieces


@pytest.mark.parametrize("name, adds_bos", [("llama-bpe", True), ("tekken", True), ("qwen2", False),
                                            ("smollm", False), ("smaug-bpe", False), ("gpt-2", False)])
def test_bos_default_when_the_file_does_not_say(name: str, adds_bos: bool, mixed: Path, gguf_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(write_gguf(mixed, gguf_dir / f"nobos-{name}.gguf", Q.F16, pre=name, add_bos=None))
    assert (tok.encode("hi")[0] == tok.bos_token_id) is adds_bos
    forced = write_gguf(mixed, gguf_dir / f"bos-{name}.gguf", Q.F16, pre=name, add_bos=not adds_bos)
    assert (Tokenizer.from_pretrained(forced).encode("hi")[0] == tok.bos_token_id) is (not adds_bos)


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_whole_words_only_where_llama_cpp_ignores_merges(name: str) -> None:
    """"abc" is in the vocabulary but no merge makes it: one token only with ignore_merges
    (Llama 3's group and tekken)."""
    alphabet = [chr(c) for c in range(33, 127)]
    tokens = [*alphabet, "ab", "abc"]
    tok = byte_level_bpe(tokens, [TokenType.NORMAL] * len(tokens), ["a b"], name)
    expected = ["abc"] if name in {"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "midm-2.0",
                                   "lfm2", "tekken"} else ["ab", "c"]
    assert tok.encode("abc").tokens == expected


def test_generate_runs_a_smollm_gguf_with_its_own_tokenizer(mixed: Path, gguf_dir: Path) -> None:
    """`infer generate` on a GGUF file naming SmolLM's pre-tokenizer, no tokenizer.json near it:
    the text it prints is what the library API generates with the file's tokenizer."""
    path = write_gguf(mixed, gguf_dir / "smollm-q8.gguf", Q.Q8_0, pre="smollm", add_bos=False)
    prompt = "def parse(x: int) -> 12345 日本語"
    out = subprocess.run([sys.executable, "-m", "infer.cli", "generate", "--model", str(path), "--device", "cpu",
                          "--max-tokens", "6", "--prompt", prompt], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with LLM(str(path), device="cpu") as llm:
        assert llm.tokenizer is not None and llm.tokenizer.name_or_path == str(path)
        result = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert result.prompt_token_ids == _reference("smollm", mixed, path).encode(prompt).ids
    assert out.stdout.startswith(prompt + result.outputs[0].text)
    assert "6 tokens" in out.stdout or "finish: stop" in out.stdout
