"""The reduced draft vocabulary's table (speculative/draft_vocab.py): counting, ranking,
coverage, the file's round trip and its refusals, `infer draft-vocab`, the draft's rows of
another vocabulary, and EngineConfig.spec_draft_vocab refused before any weight is read."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from helpers.checkpoints import encode, make_checkpoint
from infer.cli import main
from infer.engine.config import EngineConfig
from infer.engine.loading import load_models_for, load_tokenizer
from infer.speculative.draft_vocab import DraftVocab, build_table, count_tokens, coverage, draft_rows, load_table
from infer.speculative.vocab_map import VocabMap


def test_counts_rank_and_cover() -> None:
    counts = count_tokens([[5, 3, 5, 2], [3, 5, 9]])
    assert counts == Counter({5: 3, 3: 2, 2: 1, 9: 1})
    table = build_table(counts, 3, 10, "two streams")
    assert table.token_ids == (5, 3, 2)  # ties: the lower id first
    assert table.corpus_tokens == 7 and table.coverage == pytest.approx(6 / 7)
    assert coverage(counts, [9, 9, 4]) == pytest.approx(1 / 7)
    assert coverage(Counter(), [1]) == 0.0


def test_always_leads_and_short_corpora_fill() -> None:
    table = build_table(Counter({4: 5, 6: 1}), 4, 8, "c", always=[1, 99])  # (99: outside, ignored)
    assert table.token_ids == (1, 4, 6, 0)
    assert table.coverage == 1.0
    with pytest.raises(ValueError, match="1..8"):
        build_table(Counter({4: 1}), 9, 8, "c")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_table(Counter({8: 1}), 2, 8, "c")


def test_file_round_trip(tmp_path: Path) -> None:
    table = build_table(Counter({7: 3, 2: 1, 5: 2}), 2, 16, "a corpus")
    table.save(tmp_path / "t.json")
    assert load_table(tmp_path / "t.json") == table
    assert "2 of 16 tokens" in table.describe() and "83.33%" in table.describe()


@pytest.mark.parametrize("content, says", [
    (None, "no file"), ("{", "not a draft vocabulary file"), ('{"format": "other"}', "not a draft vocabulary file"),
    ('{"format": "infer-draft-vocab", "version": 1, "vocab_size": 4, "corpus": "c", "corpus_tokens": 1, '
     '"coverage": 1.0}', "token_ids"),
    ('{"format": "infer-draft-vocab", "version": 1, "vocab_size": 4, "corpus": "c", "corpus_tokens": 1, '
     '"coverage": 1.0, "token_ids": [1, 1]}', "distinct"),
    ('{"format": "infer-draft-vocab", "version": 1, "vocab_size": 4, "corpus": "c", "corpus_tokens": 1, '
     '"coverage": 1.0, "token_ids": [1, 4]}', "0..3"),
    ('{"format": "infer-draft-vocab", "version": 1, "size": 3, "vocab_size": 4, "corpus": "c", '
     '"corpus_tokens": 1, "coverage": 1.0, "token_ids": [1, 2]}', "size 3"),
])
def test_bad_files_are_refused(tmp_path: Path, content: str | None, says: str) -> None:
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=says):
        load_table(path)


def test_rows_of_another_vocabulary() -> None:
    # target "a" "b" "c" "d"; draft "c" "x" "a": target ids 2 and 0 are draft ids 0 and 2
    vocab = VocabMap.intersect([b"a", b"b", b"c", b"d"], 4, [b"c", b"x", b"a"], 3)
    table = DraftVocab((3, 2, 0), 4, "c", 1, 1.0)
    assert draft_rows(table, None) == [3, 2, 0]
    assert draft_rows(table, vocab) == [0, 2]
    with pytest.raises(ValueError, match="no token of the table"):
        draft_rows(DraftVocab((1, 3), 4, "c", 1, 1.0), vocab)


@pytest.mark.parametrize("extra, says", [
    (dict(speculative_method="ngram"), "speculative_method='draft_model'"),
    (dict(tensor_parallel_draft="sharded"), "tensor_parallel_draft='driver'"),
])
def test_config_refusals(tmp_path: Path, extra: dict, says: str) -> None:
    path = tmp_path / "t.json"
    DraftVocab((1,), 4, "c", 1, 1.0).save(path)
    with pytest.raises(ValueError, match=says):
        EngineConfig(spec_draft_vocab=str(path), **extra)
    with pytest.raises(ValueError, match="no file"):
        EngineConfig(spec_draft_vocab=str(tmp_path / "missing.json"))
    assert EngineConfig(spec_draft_vocab=str(path)).use_speculative_decoding  # (the field turns it on)


def test_another_vocabulary_is_refused_before_loading(ckpt_a: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.json"
    DraftVocab((1, 2), 100, "c", 1, 1.0).save(path)

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read")

    monkeypatch.setattr("infer.engine.loading.load_target", no_weights)
    config = EngineConfig(model=str(ckpt_a), draft_model=str(ckpt_a), spec_draft_vocab=str(path), device="cpu")
    with pytest.raises(ValueError, match="vocabulary of 100 tokens, the target has 384"):
        load_models_for(config)


def test_cli_builds_a_table_of_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_checkpoint(tmp_path / "m", variant="a")
    text = "the cat sat on the mat and the dog sat on the log"
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "t.json"
    assert main(["draft-vocab", "--model", str(ckpt), "--size", "5", "--out", str(out),
                 "--files", str(tmp_path / "a.txt")]) == 0
    table = load_table(out)
    counts = Counter(encode(ckpt, text, add_bos=False))
    assert table.size == 5 and table.vocab_size == 384 and table.corpus_tokens == sum(counts.values())
    assert table.coverage == pytest.approx(coverage(counts, table.token_ids))
    eos = list(load_tokenizer(str(ckpt)).eos_token_ids)  # (always kept, first)
    ranked = [t for t in sorted(counts, key=lambda t: (-counts[t], t)) if t not in eos]
    assert list(table.token_ids) == (eos + ranked)[:5]
    assert f"wrote {out}" in capsys.readouterr().out
    assert json.loads(out.read_text())["size"] == 5
    assert main(["draft-vocab", "--model", str(ckpt), "--size", "5", "--out", str(out),
                 "--files", str(tmp_path / "none.txt")]) == 2


def test_costs_row_of_a_reduced_draft(ckpt_a: Path) -> None:
    """The costs suite's reduced-vocabulary row loads the draft with a table of the lowest ids
    through the engine's loader and times it (a CPU here: a measured c, no failure)."""
    from infer_bench import measures
    from infer_bench.harness import Harness, HarnessOptions
    from infer_bench.results import BenchRun

    row = measures.costs_row("costs", "c", str(ckpt_a), str(ckpt_a), False, draft_vocab=96)
    run = BenchRun("t")
    Harness(run, HarnessOptions(device="cpu", quiet=True, cost_repeats=1)).run_rows(["costs"], {"costs": row})
    m = run.get("costs")
    assert m.ok, m.error
    assert m.params["draft_vocab"] == 96 and m.metrics["c"] is not None
