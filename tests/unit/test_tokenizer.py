"""Tokenizer tests: the real Llama 3 tokenizer.model (tiktoken backend, checked against
llama_models' own tokenizer), a tiny byte-level BPE trained here (tokenizer.json backend),
chat templates, streaming detokenization and error cases."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from infer.tokenization.backends import split_for_tiktoken
from infer.tokenization import IncrementalDetokenizer, Tokenizer

llama_models = pytest.importorskip("llama_models")
from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer  # noqa: E402

LLAMA3_MODEL = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
REPLACEMENT = "\ufffd"

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "code": "def f(x: int) -> int:\n\treturn {'a': x ** 2}[\"a\"]  # done\n\n",
    "cjk": "日本語のテキストと中文字符，还有한국어, 饕餮 龘靐齉 𠀀𪚥.",
    "emoji": "llamas 🦙🦙 are great 👍🏽 🇫🇷 ❤️",
    "accents": "café naïve façade Ångström Straße żółć ǅ ẞ ű ŧ ṩ ḝ",
    "math_letters": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ∑∫√",
    "whitespace": "  leading\n\n\n  and trailing   \r\n",
}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama3")
    shutil.copy(LLAMA3_MODEL, directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="module")
def llama3(llama3_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama3_dir)


@pytest.fixture(scope="module")
def meta() -> MetaTokenizer:
    return MetaTokenizer(LLAMA3_MODEL)


TINY_SPECIALS = ["<s>", "</s>", "<|eot|>", "<pad>"]
TINY_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}\n"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('bad role ' + m['role']) }}\n"
    "  {% endif %}\n"
    "[{{ m['role'] }}] {{ m['content'] }}<|eot|>\n"
    "{% endfor %}\n"
    "{% if tools %}TOOLS {{ tools | tojson(indent=2) }}\n{% endif %}\n"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _train_tiny_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=TINY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["hello world, the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(corpus + ["日本語 😀 café naïve"] * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value), encoding="utf-8")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    tok = _train_tiny_bpe()
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "bos_token": "<s>", "eos_token": "<|eot|>",
        "pad_token": "<pad>", "chat_template": TINY_TEMPLATE})
    _write_json(directory / "generation_config.json",
                {"bos_token_id": tok.token_to_id("<s>"), "eos_token_id": [tok.token_to_id("</s>")]})
    return directory


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------- Llama 3 (tiktoken)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_llama3_round_trip_and_reference_ids(llama3: Tokenizer, meta: MetaTokenizer,
                                             name: str) -> None:
    text = TEXTS[name]
    ids = llama3.encode(text)
    assert ids == meta.encode(text, bos=True, eos=False)
    assert llama3.decode(ids[1:]) == text
    assert llama3.decode(ids, skip_special_tokens=True) == text
    assert llama3.encode(text, add_special_tokens=False) == ids[1:]


def test_llama3_known_ids(llama3: Tokenizer, meta: MetaTokenizer) -> None:
    assert llama3.encode("hello world") == meta.encode("hello world", bos=True, eos=False)
    assert llama3.token_to_id("<|begin_of_text|>") == 128000
    assert llama3.encode("hello world")[0] == 128000
    assert llama3.bos_token_id == meta.bos_id == 128000
    assert llama3.vocab_size == meta.n_words == 128256
    assert llama3.eos_token_ids == (128001, 128008, 128009)
    assert set(llama3.eos_token_ids) == set(meta.stop_tokens)
    assert llama3.pad_token_id == meta.pad_id == 128004
    named = {"<|end_of_text|>": 128001, "<|finetune_right_pad_id|>": 128004,
             "<|start_header_id|>": 128006, "<|end_header_id|>": 128007,
             "<|eom_id|>": 128008, "<|eot_id|>": 128009, "<|python_tag|>": 128010}
    for token, token_id in named.items():
        assert llama3.token_to_id(token) == token_id


def test_llama3_special_tokens_match_reference(llama3: Tokenizer, meta: MetaTokenizer) -> None:
    assert len(meta.special_tokens) == 256
    for token, token_id in meta.special_tokens.items():
        assert llama3.token_to_id(token) == token_id
        assert llama3.encode(token, add_special_tokens=False) == [token_id]
        assert llama3.decode([token_id]) == token
        assert llama3.convert_ids_to_tokens(token_id) == token
        assert llama3.is_special(token_id)
    assert not llama3.is_special(llama3.encode("hello", add_special_tokens=False)[0])


def test_llama3_special_strings_in_text_are_parsed(llama3: Tokenizer, meta: MetaTokenizer) -> None:
    ids = llama3.encode("Hi there<|eot_id|>Bye", add_special_tokens=False)
    expected = meta.encode("Hi there", bos=False, eos=False) + [meta.eot_id] + \
        meta.encode("Bye", bos=False, eos=False)
    assert ids == expected
    assert llama3.decode(ids) == "Hi there<|eot_id|>Bye"
    assert llama3.decode(ids, skip_special_tokens=True) == "Hi thereBye"


def test_llama3_token_strings_use_byte_level_alphabet(llama3: Tokenizer) -> None:
    ids = llama3.encode(" hello world\n", add_special_tokens=False)
    assert llama3.convert_ids_to_tokens(ids) == ["Ġhello", "Ġworld", "Ċ"]
    single_bytes = {llama3.convert_ids_to_tokens(i) for i in range(256)}
    assert single_bytes == set(pre_tokenizers.ByteLevel.alphabet())
    for token_id in llama3.encode(TEXTS["emoji"] + TEXTS["code"], add_special_tokens=False):
        assert llama3.token_to_id(llama3.convert_ids_to_tokens(token_id)) == token_id


def test_llama3_original_subdir_and_generation_config(tmp_path: Path, llama3: Tokenizer) -> None:
    (tmp_path / "original").mkdir()
    shutil.copy(LLAMA3_MODEL, tmp_path / "original" / "tokenizer.model")
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": 128009})
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (llama3.token_to_id("<|eot_id|>"),)
    assert tok.encode("hi") == llama3.encode("hi")


def test_llama3_builtin_chat_template(llama3: Tokenizer, meta: MetaTokenizer) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2+2? 🤔"}]
    expected = ("<|begin_of_text|>"
                "<|start_header_id|>system<|end_header_id|>\n\n"
                "You are a helpful assistant.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\n"
                "What is 2+2? 🤔<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert llama3.apply_chat_template(messages) == expected
    ids = llama3.apply_chat_template(messages, tokenize=True)
    assert isinstance(ids, list) and ids.count(meta.bos_id) == 1 and ids[0] == meta.bos_id

    def piece(text: str) -> list[int]:
        return meta.encode(text, bos=False, eos=False)

    sp = meta.special_tokens
    by_hand = [meta.bos_id]
    for role, content in [("system", messages[0]["content"]), ("user", messages[1]["content"])]:
        by_hand += [sp["<|start_header_id|>"], *piece(role), sp["<|end_header_id|>"],
                    *piece("\n\n"), *piece(content), meta.eot_id]
    by_hand += [sp["<|start_header_id|>"], *piece("assistant"), sp["<|end_header_id|>"],
                *piece("\n\n")]
    assert ids == by_hand


def test_llama3_builtin_template_tool_role_parts_and_no_prompt(llama3: Tokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": " Weather? "}]},
                {"role": "assistant", "content": "Calling."},
                {"role": "tool", "content": "{\"temp\": 20}"}]
    text = llama3.apply_chat_template(messages, add_generation_prompt=False)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nCalling.<|eot_id|>"
                    "<|start_header_id|>ipython<|end_header_id|>\n\n{\"temp\": 20}<|eot_id|>")


# ------------------------------------------------------- streaming decoding


def _stream(tok: Tokenizer, ids: Sequence[int], **kwargs: object) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    deltas = [det.push(i) for i in ids]
    deltas.append(det.flush())
    return deltas, det.text


@pytest.mark.parametrize("name", ["emoji", "cjk", "math_letters", "accents"])
def test_stream_multibyte_never_emits_broken_characters(llama3: Tokenizer, name: str) -> None:
    ids = llama3.encode(TEXTS[name], add_special_tokens=False)
    pieces = [llama3.decode([i]) for i in ids]
    assert any(REPLACEMENT in p for p in pieces), "text must split a character across tokens"
    deltas, text = _stream(llama3, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text == llama3.decode(ids) == TEXTS[name]


def test_stream_after_chat_prompt_skips_specials(llama3: Tokenizer) -> None:
    prompt = llama3.apply_chat_template([{"role": "user", "content": "Say 🦙"}], tokenize=True)
    generated = llama3.encode("🦙 日本 ok", add_special_tokens=False) + [128009]
    deltas, text = _stream(llama3, generated, prompt_ids=prompt)
    assert all(REPLACEMENT not in d for d in deltas)
    assert text == llama3.decode(generated, skip_special_tokens=True) == "🦙 日本 ok"
    _, with_specials = _stream(llama3, generated, prompt_ids=prompt, skip_special_tokens=False)
    assert with_specials == llama3.decode(generated) == "🦙 日本 ok<|eot_id|>"


def test_stream_holds_unfinished_character_until_flush(llama3: Tokenizer) -> None:
    emoji_bytes = llama3.encode("🦙", add_special_tokens=False)
    assert len(emoji_bytes) > 1
    head = llama3.encode("ok ", add_special_tokens=False) + emoji_bytes[:-1]
    det = IncrementalDetokenizer(llama3)
    deltas = [det.push(i) for i in head]
    assert "".join(deltas) == "ok " and det.text == "ok "
    tail = det.flush()
    assert det.text == llama3.decode(head) and tail.startswith(REPLACEMENT)
    assert det.flush() == ""


class _CountingTokenizer:
    """Records the length of every decode call made through it."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stream_decodes_a_bounded_window(llama3: Tokenizer) -> None:
    ids = llama3.encode(" ".join(TEXTS.values()) * 20, add_special_tokens=False)
    assert len(ids) > 1000
    counting = _CountingTokenizer(llama3)
    prompt = llama3.encode("a prompt with several tokens in it")
    det = IncrementalDetokenizer(counting, prompt_ids=prompt)
    for i in ids:
        det.push(i)
    det.flush()
    assert det.text == llama3.decode(ids)
    assert max(counting.lengths) <= 16
    assert len(counting.lengths) <= 2 * len(ids) + 2


def test_stream_metaspace_keeps_leading_space_with_prompt_context() -> None:
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox jumps"] * 20, trainer)
    from infer.tokenization.backends import HFTokenizersBackend
    wrapped = Tokenizer(HFTokenizersBackend(tok), name_or_path="metaspace", token_strings={})
    ids = wrapped.encode("hello world the fox", add_special_tokens=False)
    prompt, generated = ids[:1], ids[1:]
    _, text = _stream(wrapped, generated, prompt_ids=prompt)
    full = wrapped.decode(ids)
    assert text == full[len(wrapped.decode(prompt)):] == " world the fox"


# ----------------------------------------------------- tokenizer.json backend


def test_tiny_bpe_ids_and_round_trip(tiny: Tokenizer, tiny_dir: Path) -> None:
    raw = HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    eot, eos, bos = raw.token_to_id("<|eot|>"), raw.token_to_id("</s>"), raw.token_to_id("<s>")
    assert tiny.eos_token_ids == tuple(sorted({eot, eos}))
    assert tiny.bos_token_id == bos and tiny.pad_token_id == raw.token_to_id("<pad>")
    assert tiny.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    for text in ["hello world", TEXTS["cjk"], TEXTS["emoji"], TEXTS["accents"]]:
        ids = tiny.encode(text)
        assert ids[0] == bos and ids[1:] == raw.encode(text, add_special_tokens=False).ids
        assert tiny.decode(ids, skip_special_tokens=True) == text
        assert tiny.encode(text, add_special_tokens=False) == ids[1:]
    assert tiny.encode("hi<|eot|>", add_special_tokens=False)[-1] == eot
    assert tiny.is_special(eot) and not tiny.is_special(tiny.encode("h", False)[0])
    deltas, text = _stream(tiny, tiny.encode(TEXTS["emoji"], add_special_tokens=False))
    assert all(REPLACEMENT not in d for d in deltas) and text == TEXTS["emoji"]


def test_tiny_bpe_chat_template(tiny: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi 😀"}]
    assert tiny.apply_chat_template(messages) == \
        "<s>[system] Be brief.<|eot|>\n[user] hi 😀<|eot|>\n[assistant] "
    assert tiny.apply_chat_template(messages, add_generation_prompt=False) == \
        "<s>[system] Be brief.<|eot|>\n[user] hi 😀<|eot|>\n"
    tools = [{"name": "f", "description": "café"}]
    with_tools = tiny.apply_chat_template(messages[1:], add_generation_prompt=False, tools=tools)
    assert with_tools == "<s>[user] hi 😀<|eot|>\nTOOLS " + json.dumps(
        tools, indent=2, ensure_ascii=False) + "\n"
    ids = tiny.apply_chat_template(messages, tokenize=True)
    assert ids.count(tiny.bos_token_id) == 1 and ids[0] == tiny.bos_token_id
    with pytest.raises(ValueError, match="bad role tool"):
        tiny.apply_chat_template([{"role": "tool", "content": "x"}])


def test_tiny_bpe_template_matches_transformers(tiny: Tokenizer, tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tiny.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tiny.encode("hello world") == reference.encode("hello world")


def test_chat_template_jinja_file_wins_and_helpers(tiny_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(tiny_dir, tmp_path / "m")
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m.content | upper }}{% endgeneration %}"
        "{% endfor %}|{{ eos_token }}|{{ strftime_now('%Y') | length }}", encoding="utf-8")
    tok = Tokenizer.from_pretrained(directory)
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "AB|<|eot|>|4"


def test_explicit_add_bos_and_eos_flags(tiny_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(tiny_dir, tmp_path / "m")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    eos_entry = {"__type": "AddedToken", "content": "<|eot|>", "special": True}
    _write_json(directory / "tokenizer_config.json",
                {**config, "eos_token": eos_entry, "add_bos_token": False, "add_eos_token": True})
    tok = Tokenizer.from_pretrained(directory)
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == plain + [tok.token_to_id("<|eot|>")]


def test_special_tokens_map_and_named_template_list(tiny_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    shutil.copy(tiny_dir / "tokenizer.json", directory / "tokenizer.json")
    _write_json(directory / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>"})
    _write_json(directory / "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]})
    tok = Tokenizer.from_pretrained(directory)
    assert tok.bos_token_id == tok.token_to_id("<s>")
    assert tok.eos_token_ids == (tok.token_to_id("</s>"),)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "D</s>"


# --------------------------------------------------------------- error cases


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_directory_without_tokenizer_file(tmp_path: Path) -> None:
    _write_json(tmp_path / "config.json", {})
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer.model"):
        Tokenizer.from_pretrained(tmp_path)


def test_sentencepiece_model_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\xff")
    with pytest.raises(ValueError, match="tiktoken"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("messages, problem", [
    ([], "empty"),
    ("hello", "must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
     r"messages\[1\] has unknown role 'robot'"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
    ([{"role": "user", "content": [{"type": "text"}]}], "without a 'text' string"),
])
def test_bad_messages_raise(llama3: Tokenizer, messages: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        llama3.apply_chat_template(messages)  # type: ignore[arg-type]


def test_assistant_tool_call_without_content_is_accepted(llama3: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}]
    text = llama3.apply_chat_template(messages, add_generation_prompt=False)
    # (the built-in template renders no tool_calls itself: they become the content, as Llama 3 JSON)
    assert text.endswith('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "f", "parameters": {}}<|eot_id|>')


def test_out_of_range_ids_raise(llama3: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.decode([1, llama3.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3.convert_ids_to_tokens(-1)


def test_no_chat_template_raises(tiny_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    shutil.copy(tiny_dir / "tokenizer.json", directory / "tokenizer.json")
    tok = Tokenizer.from_pretrained(directory)
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_split_for_tiktoken_limits() -> None:
    text = "ab cd  " + "x" * 23 + " \n" + " " * 12 + "end"
    pieces = split_for_tiktoken(text, max_chars=10, max_run=5)
    assert "".join(pieces) == text
    assert all(0 < len(p) <= 10 for p in pieces)
    assert all(len(run) <= 5 for piece in pieces for run in re.findall(r"\s+|\S+", piece))
    assert split_for_tiktoken("short text", max_chars=100, max_run=50) == ["short text"]


# ------------------------------------------------------------- vocabulary


def test_vocabulary_lists_the_string_of_every_id(llama3: Tokenizer, tiny: Tokenizer) -> None:
    """What a draft and its target are compared on (engine/pairing.py), on both backends."""
    for tok in (llama3, tiny):
        vocab = tok.vocabulary()
        assert len(vocab) == tok.vocab_size
        assert vocab[tok.bos_token_id] == tok.bos_token
        ids = tok.encode("hello world, 123 ünï", add_special_tokens=False)
        assert [vocab[i] for i in ids] == tok.convert_ids_to_tokens(ids)
    assert Tokenizer.from_pretrained(llama3.name_or_path).vocabulary() == llama3.vocabulary()
