"""A draft is checked against its target from files before either model's weights are read:
different vocabulary sizes, or the same size with different tokens, are errors that say what
to do; padding ids and tokenizer-less dummy shapes are not compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from helpers.checkpoints import copy_checkpoint
from helpers.gguf_files import write_gguf
from helpers.mixed_vocab import make_mixed_checkpoint
from infer.engine.config import EngineConfig
from infer.engine.loading import load_models
from infer.engine.pairing import VocabularyFacts, check_pair

TOKENS = ["<s>", "</s>", "a", "b", "ab"]


def test_same_vocabulary_passes_and_padding_ids_are_not_compared() -> None:
    check_pair(VocabularyFacts("t", 5, TOKENS), VocabularyFacts("d", 5, list(TOKENS)))
    padded = VocabularyFacts("t", 8, [*TOKENS, "[PAD5]", "[PAD6]", "[PAD7]"])  # a GGUF's padding rows
    check_pair(padded, VocabularyFacts("d", 8, [*TOKENS, None, None, None]))  # a tokenizer.json's
    check_pair(VocabularyFacts("t", 5, None), VocabularyFacts("d", 5, TOKENS))  # a dummy shape


def test_different_vocabulary_sizes_are_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"'d' has a vocabulary of 6 ids and the target 't' 5") as error:
        check_pair(VocabularyFacts("t", 5, TOKENS), VocabularyFacts("d", 6, [*TOKENS, "c"]))
    assert "same family" in str(error.value) and "ngram" in str(error.value)


def test_same_size_with_different_tokens_is_an_error_naming_them() -> None:
    draft = VocabularyFacts("d", 5, ["<s>", "</s>", "b", "a", "ab"])
    with pytest.raises(ValueError, match=r"different tokenizers \(2 of 5 ids differ: id 2 is 'b' in the draft "
                                         r"and 'a' in the target"):
        check_pair(VocabularyFacts("t", 5, TOKENS), draft)


def test_facts_are_validated() -> None:
    with pytest.raises(ValueError, match="0 ids"):
        VocabularyFacts("m", 0, [])


# --- through the loader, before any weight -------------------------------------------


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.engine.loading as loading

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a model was loaded before the pair was checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def _config(target: Path, draft: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(target), draft_model=str(draft), device="cpu",
                                    use_speculative_decoding=True)


@pytest.mark.usefixtures("no_weights")
def test_a_draft_of_another_vocabulary_size_fails_before_loading(ckpt_b: Path, tmp_path: Path) -> None:
    other = make_mixed_checkpoint(tmp_path / "mixed")
    draft = write_gguf(other, tmp_path / "mixed.gguf", Q.Q8_0, pre="smollm")  # a GGUF draft: metadata only
    with pytest.raises(ValueError, match=r"vocabulary of \d+ ids and the target .* 384"):
        load_models(_config(ckpt_b, draft))


@pytest.mark.usefixtures("no_weights")
def test_a_draft_with_the_same_size_but_other_tokens_fails_before_loading(ckpt_a: Path, ckpt_b: Path,
                                                                          tmp_path: Path) -> None:
    draft = copy_checkpoint(ckpt_b, tmp_path / "swapped")
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = (token for token, i in vocab.items() if i in (100, 101))
    vocab[first], vocab[second] = vocab[second], vocab[first]  # merges name strings: still valid
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"different tokenizers \(2 of 384 ids differ: id 100"):
        load_models(_config(ckpt_a, draft))
    with pytest.raises(AssertionError, match="loaded before"):  # a matching pair gets to the weights
        load_models(_config(ckpt_a, ckpt_b))


@pytest.mark.usefixtures("no_weights")
def test_a_draft_gguf_with_an_unknown_pre_tokenizer_says_it_is_the_draft(ckpt_a: Path, ckpt_b: Path,
                                                                          tmp_path: Path) -> None:
    draft = write_gguf(ckpt_b, tmp_path / "draft.gguf", Q.F16, pre="superbpe")
    with pytest.raises(ValueError, match="the draft model's tokenizer.*'superbpe'"):
        load_models(_config(ckpt_a, draft))
