"""A reduced draft vocabulary (frequency-ranked drafting, FR-Spec, Zhao et al. 2025): the N
target ids most frequent in a corpus, whose lm_head rows alone a draft computes
(`LlamaForCausalLM.keep_vocab`). q is zero outside them, so verification stays lossless.

`DraftVocab` is the table (JSON, written by `infer draft-vocab`, or shipped by name); `build_table` ranks counted
tokens; `draft_rows` gives the kept rows in the draft's own ids."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the engine's config reads the shipped tables' names: no torch at import)
    from infer.speculative.vocab_map import VocabMap

FORMAT = "infer-draft-vocab"
VERSION = 1
# tables shipped with the package, by name (`spec_draft_vocab="llama3-32k"`, `table_path`)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "draft_vocabs"
SHIPPED = ("llama3-32k", "demo-6k")


@dataclass(frozen=True)
class DraftVocab:
    token_ids: tuple[int, ...]  # [N] target ids, most frequent first (ids of `always` lead)
    vocab_size: int  # the target tokenizer's vocabulary the ids index (its logits)
    corpus: str  # what was counted, in words
    corpus_tokens: int  # tokens counted
    coverage: float  # share of the counted tokens inside the table

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a draft vocabulary needs at least one token id")
        if len(set(self.token_ids)) != len(self.token_ids):
            raise ValueError("a draft vocabulary's token ids must be distinct")
        if min(self.token_ids) < 0 or max(self.token_ids) >= self.vocab_size:
            raise ValueError(f"a draft vocabulary's token ids must lie in 0..{self.vocab_size - 1} "
                             f"(its vocab_size), got {min(self.token_ids)}..{max(self.token_ids)}")

    @property
    def size(self) -> int:
        return len(self.token_ids)

    def describe(self) -> str:
        return (f"{self.size} of {self.vocab_size} tokens, covering {self.coverage:.2%} of "
                f"{self.corpus_tokens} tokens of {self.corpus}")

    def check_target(self, vocab_size: int, source: str) -> None:
        """Raise unless the table indexes a vocabulary of `vocab_size` logits."""
        if vocab_size != self.vocab_size:
            raise ValueError(f"{source} was built for a vocabulary of {self.vocab_size} tokens, the target has "
                             f"{vocab_size}: build it with the target's tokenizer (`infer draft-vocab --model ...`)")

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, "version": VERSION, "size": self.size, "vocab_size": self.vocab_size,
                "corpus": self.corpus, "corpus_tokens": self.corpus_tokens, "coverage": self.coverage,
                "token_ids": list(self.token_ids)}
        Path(path).write_text(json.dumps(data) + "\n")


def table_path(value: str | Path) -> Path:
    """The file of a `spec_draft_vocab` value (a shipped table's name or a path); ValueError if none."""
    path = SHIPPED_DIR / f"{value}.json" if str(value) in SHIPPED else Path(value)
    if not path.is_file():
        raise ValueError(f"spec_draft_vocab: no file {str(value)!r}: build one with `infer draft-vocab` (README, "
                         f"\"Speculative decoding\"), or name a shipped table ({', '.join(SHIPPED)})")
    return path


def load_table(path: str | Path) -> DraftVocab:
    """The table in a file `save` wrote, or a shipped one by name; ValueError naming what is wrong."""
    path = table_path(path)
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"spec_draft_vocab: {path} is not a draft vocabulary file (JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"spec_draft_vocab: {path} is not a draft vocabulary file (format {FORMAT!r} "
                         f"version {VERSION}): build one with `infer draft-vocab`")
    try:
        ids = tuple(int(i) for i in data["token_ids"])
        table = DraftVocab(ids, int(data["vocab_size"]), str(data["corpus"]), int(data["corpus_tokens"]),
                           float(data["coverage"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"spec_draft_vocab: {path}: {exc}") from None
    if int(data.get("size", table.size)) != table.size:
        raise ValueError(f"spec_draft_vocab: {path} says size {data['size']} but holds {table.size} ids")
    return table


def lowest_ids(vocab_size: int, size: int) -> DraftVocab:
    """A table of a vocabulary's `size` lowest ids (for benchmarks on dummy weights)."""
    return DraftVocab(tuple(range(min(size, vocab_size))), vocab_size, "the lowest ids (a benchmark's)", 0, 0.0)


def count_tokens(streams: Iterable[Sequence[int]]) -> Counter[int]:
    """How often each token id occurs in the streams."""
    counts: Counter[int] = Counter()
    for stream in streams:
        counts.update(stream)
    return counts


def build_table(counts: Counter[int], size: int, vocab_size: int, corpus: str,
                always: Sequence[int] = ()) -> DraftVocab:
    """The `size` ids of `counts` most frequent (ties: the lower id), after the ids of `always` (e.g.
    end-of-sequence tokens); filled with the lowest unseen ids when the corpus has fewer."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary's size must be in 1..{vocab_size} (the vocabulary), got {size}")
    outside = [i for i in counts if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"token id {outside[0]} is outside the vocabulary of {vocab_size} tokens")
    chosen = list(dict.fromkeys(i for i in always if 0 <= i < vocab_size))[:size]
    taken = set(chosen)
    ranked = sorted(counts, key=lambda i: (-counts[i], i))
    chosen += [i for i in ranked if i not in taken][:size - len(chosen)]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [i for i in range(vocab_size) if i not in taken][:size - len(chosen)]
    total = sum(counts.values())
    return DraftVocab(tuple(chosen), vocab_size, corpus, total, coverage(counts, chosen))


def coverage(counts: Counter[int], ids: Iterable[int]) -> float:
    """The share of the counted tokens that are among `ids` (0 for no tokens)."""
    total = sum(counts.values())
    return sum(counts[i] for i in set(ids)) / total if total else 0.0


def draft_rows(table: DraftVocab, vocab: VocabMap | None) -> list[int]:
    """The draft's own ids whose rows it keeps: the table's ids, or for a draft of another
    vocabulary the draft ids the table's target ids are proposed from (`VocabMap.probs_source`)."""
    if vocab is None:
        return list(table.token_ids)
    source = vocab.probs_source()  # [V_t] the draft id proposed as each target id, -1: none
    rows = [int(source[t]) for t in table.token_ids if t < len(source) and int(source[t]) >= 0]
    if not rows:
        raise ValueError("spec_draft_vocab: no token of the table is shared with the draft's vocabulary")
    return rows
