"""What each token id stands for across tokenizers (tokenization/token_keys.py): bytes for
byte-level and SentencePiece vocabularies alike, a special token's name, an added token's
text; the same text token spells its bytes in the tiktoken and tokenizer.json backends alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from infer.tokenization import Tokenizer
from infer.tokenization.backends import HFTokenizersBackend, decoder_form
from infer.tokenization.token_keys import metaspace_bytes, vocabulary_keys


def test_metaspace_strings_and_byte_fallback_tokens_are_bytes() -> None:
    assert metaspace_bytes("\u2581the") == b" the"
    assert metaspace_bytes("<0x41>") == b"A" and metaspace_bytes("<0xE2>") == b"\xe2"
    assert metaspace_bytes("<0x4>") == b"<0x4>"  # (not a byte token)


def test_the_decoder_says_the_form() -> None:
    assert decoder_form(decoders.ByteLevel().__getstate__()) == "byte_level"
    assert decoder_form(decoders.Metaspace().__getstate__()) == "metaspace"
    llama2 = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                decoders.Strip(" ", 1, 0)])
    assert decoder_form(llama2.__getstate__()) == "metaspace"
    assert decoder_form(decoders.WordPiece().__getstate__()) is None
    assert decoder_form(None) is None


def test_keys_of_specials_added_tokens_and_unknown_forms() -> None:
    strings = ["<s>", "Ġhi", "<tool>", None, "hi"]
    keys = vocabulary_keys(strings, {0}, {2: "<tool>"}, "byte_level")
    assert keys == ["<s>", b" hi", b"<tool>", None, b"hi"]
    assert vocabulary_keys(strings, {0}, {}, None) == ["<s>", None, None, None, None]


def _metaspace_tokenizer() -> Tokenizer:
    vocab = {"<s>": 0, "<0x41>": 1, "\u2581the": 2, "A": 3, "\u2581": 4, "t": 5, "h": 6, "e": 7, "\u2581t": 8,
             "\u2581th": 9}
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e")]
    tok = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    return Tokenizer(HFTokenizersBackend(tok), name_or_path="metaspace", token_strings={})


def test_a_sentencepiece_vocabulary_and_a_byte_level_one_share_their_text(tiny_model_dir: Path) -> None:
    spm = _metaspace_tokenizer().token_keys()
    assert spm[:4] == ["<s>", b"A", b" the", b"A"]  # "<0x41>" and "A": one key, two ids
    byte_level = Tokenizer.from_pretrained(tiny_model_dir).token_keys()
    assert b" the" in byte_level and "<s>" in byte_level  # the test tokenizer's " the" and BOS


def test_tiktoken_keys_spell_the_text_and_name_the_specials(tmp_path: Path) -> None:
    llama_models = pytest.importorskip("llama_models")
    model = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    (tmp_path / "tokenizer.model").write_bytes(model.read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    keys = tok.token_keys()
    assert len(keys) == tok.vocab_size and keys[tok.bos_token_id] == "<|begin_of_text|>"
    ids = tok.encode(" hello wörld", add_special_tokens=False)
    assert b"".join(keys[i] for i in ids) == " hello wörld".encode()  # type: ignore[misc]
