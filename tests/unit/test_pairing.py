"""A draft is checked against its target from files before either model's weights are read:
the same vocabulary passes as is (padding ids and tokenizer-less dummy shapes are not
compared); another vocabulary, of another size or with other tokens, is mapped over the
tokens both share when they share enough, refused with the figure and what to do when they
share too little, and refused without tokenizers to compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from helpers.checkpoints import copy_checkpoint
from helpers.gguf_files import write_gguf
from helpers.mixed_vocab import make_mixed_checkpoint
from helpers.foreign_vocab import narrow_draft
from infer.engine.config import EngineConfig
from infer.engine.loading import check_before_loading, load_models_for, load_part
from infer.engine.pairing import MIN_SHARED, VocabularyFacts, check_pair

TOKENS = ["<s>", "</s>", "a", "b", "ab"]
KEYS = ["<s>", "</s>", b"a", b"b", b"ab"]


def test_same_vocabulary_passes_and_padding_ids_are_not_compared() -> None:
    assert check_pair(VocabularyFacts("t", 5, TOKENS, KEYS), VocabularyFacts("d", 5, list(TOKENS), KEYS)) is None
    padded = VocabularyFacts("t", 8, [*TOKENS, "[PAD5]", "[PAD6]", "[PAD7]"])  # a GGUF's padding rows
    assert check_pair(padded, VocabularyFacts("d", 8, [*TOKENS, None, None, None])) is None  # a tokenizer.json's
    assert check_pair(VocabularyFacts("t", 5, None), VocabularyFacts("d", 5, TOKENS)) is None  # a dummy shape


def test_another_vocabulary_is_mapped_over_the_shared_tokens() -> None:
    swapped = VocabularyFacts("d", 5, ["<s>", "</s>", "b", "a", "ab"], ["<s>", "</s>", b"b", b"a", b"ab"])
    vocab = check_pair(VocabularyFacts("t", 5, TOKENS, KEYS), swapped)
    assert vocab is not None and vocab.draft_to_target == (0, 1, 3, 2, 4) and vocab.fraction == 1.0
    wider = VocabularyFacts("d", 7, [*TOKENS, "c", None], [*KEYS, b"c", None])  # another size, a padding row
    vocab = check_pair(VocabularyFacts("t", 5, TOKENS, KEYS), wider)
    assert vocab is not None and vocab.draft_to_target == (0, 1, 2, 3, 4, -1, -1)


def test_a_pair_sharing_too_little_is_refused_with_the_figure() -> None:
    target = VocabularyFacts("t", 8, None, ["<s>", *(bytes([c]) for c in b"abcdefg")])
    enough = VocabularyFacts("d", 8, None, ["<s>", b"a", *(bytes([c]) for c in b"uvwxyz")])
    vocab = check_pair(target, enough)
    assert vocab is not None and vocab.fraction == MIN_SHARED == 0.25
    too_few = VocabularyFacts("d", 8, None, ["<s>", *(bytes([c]) for c in b"tuvwxyz")])
    with pytest.raises(ValueError, match=r"'d' has another tokenizer than the target 't' and they share too little "
                                         r"to speculate: 1 shared token, 12.5% of the smaller vocabulary \(8 tokens"
                                         r".*below the 25% .*same family.*ngram"):
        check_pair(target, too_few)


def test_without_tokenizers_another_vocabulary_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"'d' has a vocabulary of 6 ids and the target 't' 5") as error:
        check_pair(VocabularyFacts("t", 5, TOKENS), VocabularyFacts("d", 6, None))
    assert "same family" in str(error.value) and "ngram" in str(error.value)
    draft = VocabularyFacts("d", 5, ["<s>", "</s>", "b", "a", "ab"])
    with pytest.raises(ValueError, match=r"different tokenizers \(2 ids differ: id 2 is 'b' in the draft "
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
def test_a_draft_of_another_vocabulary_is_mapped_before_loading(ckpt_b: Path, tmp_path: Path) -> None:
    other = make_mixed_checkpoint(tmp_path / "mixed")
    draft = write_gguf(other, tmp_path / "mixed.gguf", Q.Q8_0, pre="smollm")  # a GGUF draft: metadata only
    _, vocab = check_before_loading(load_part(_config(ckpt_b, draft)))
    assert vocab is not None and len(vocab.draft_to_target) > 384 and MIN_SHARED <= vocab.fraction < 1
    with pytest.raises(AssertionError, match="loaded before"):  # the pair gets to the weights
        load_models_for(_config(ckpt_b, draft))


@pytest.mark.usefixtures("no_weights")
def test_a_draft_sharing_too_little_fails_before_loading(ckpt_b: Path, tmp_path: Path) -> None:
    draft = narrow_draft(tmp_path / "narrow")  # Cyrillic merges over the bytes they use
    with pytest.raises(ValueError, match=r"share too little to speculate: \d+ shared tokens, \d+\.\d% of the "
                                         r"smaller vocabulary"):
        load_models_for(_config(ckpt_b, draft))


@pytest.mark.usefixtures("no_weights")
def test_a_draft_with_the_same_size_but_other_ids_is_mapped_before_loading(ckpt_a: Path, ckpt_b: Path,
                                                                           tmp_path: Path) -> None:
    draft = copy_checkpoint(ckpt_b, tmp_path / "swapped")
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = (token for token, i in vocab.items() if i in (100, 101))
    vocab[first], vocab[second] = vocab[second], vocab[first]  # merges name strings: still valid
    (draft / "tokenizer.json").write_text(json.dumps(data))
    _, mapped = check_before_loading(load_part(_config(ckpt_a, draft)))
    assert mapped is not None and mapped.fraction == 1.0
    assert [i for i, t in enumerate(mapped.draft_to_target) if i != t] == [100, 101]
    assert check_before_loading(load_part(_config(ckpt_a, ckpt_b)))[1] is None  # the same vocabulary
    with pytest.raises(AssertionError, match="loaded before"):  # either pair gets to the weights
        load_models_for(_config(ckpt_a, draft))


@pytest.mark.usefixtures("no_weights")
def test_a_draft_gguf_with_an_unknown_pre_tokenizer_says_it_is_the_draft(ckpt_a: Path, ckpt_b: Path,
                                                                          tmp_path: Path) -> None:
    draft = write_gguf(ckpt_b, tmp_path / "draft.gguf", Q.F16, pre="superbpe")
    with pytest.raises(ValueError, match="the draft model's tokenizer.*'superbpe'"):
        load_models_for(_config(ckpt_a, draft))


def test_loading_takes_the_check_it_is_given(ckpt_a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a tensor-parallel driver checks before its workers load; its own loading reuses that
    # check's tokenizer and vocabulary map instead of building them again
    import infer.engine.loading as loading
    config = EngineConfig(model=str(ckpt_a), draft_model=str(ckpt_a), use_speculative_decoding=True)
    load = load_part(config)
    checked = check_before_loading(load)
    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was built again"))
    models = loading.load_models(load, config.speculative_part(), max_seq_len=64, checked=checked)
    assert models.tokenizer is checked[0] and models.vocab_map is None
