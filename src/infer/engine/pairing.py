"""Whether a draft model can speculate for a target, decided from their files alone.

`check_pair`: the same vocabulary proposes target ids directly; another drafts over the
tokens both share (a `VocabMap`) when they share at least MIN_SHARED of the smaller one;
otherwise it is refused with what to do. The target's stop ids decide when a request ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from infer.speculative.vocab_map import VocabMap
from infer.tokenization.token_keys import TokenKey

log = logging.getLogger("infer.engine")

MIN_SHARED = 0.25  # least shared fraction of the smaller vocabulary a draft with another tokenizer needs
ADVICE = ("choose a draft trained with the target's tokenizer (a smaller model of the same family, e.g. "
          "Qwen2.5-0.5B-Instruct for Qwen2.5-3B-Instruct), or speculate without a draft model "
          "(speculative_method='ngram' or 'prompt_lookup')")


@dataclass(frozen=True, slots=True)
class VocabularyFacts:
    """One model's side of the comparison, read without loading weights."""

    source: str  # the model's path or name, as messages show it
    logits: int  # the model's vocabulary size: rows of its embedding, width of its logits
    tokens: Sequence[str | None] | None  # its tokenizer's string for each id; None: no tokenizer
    keys: Sequence[TokenKey | None] | None = None  # what each id stands for (`Tokenizer.token_keys`)

    def __post_init__(self) -> None:
        if self.logits <= 0:
            raise ValueError(f"{self.source}: a vocabulary of {self.logits} ids is not a model's")


def check_pair(target: VocabularyFacts, draft: VocabularyFacts) -> VocabMap | None:
    """None when `draft` proposes target ids directly, a `VocabMap` when it drafts over the
    tokens the two share; ValueError, saying what to do, when it cannot draft for `target`.
    Ids a tokenizer does not define (padding rows) are not compared."""
    differ = _differing_ids(target, draft)
    if draft.logits == target.logits and not differ:
        return None
    if target.keys is None or draft.keys is None:
        if draft.logits != target.logits:
            raise ValueError(
                f"the draft {draft.source!r} has a vocabulary of {draft.logits} ids and the target "
                f"{target.source!r} {target.logits}, and without both tokenizers their tokens cannot be "
                f"matched; {ADVICE}")
        shown = ", ".join(f"id {i} is {draft.tokens[i]!r} in the draft and {target.tokens[i]!r} in the target"
                          for i in differ[:3]) if draft.tokens is not None and target.tokens is not None else ""
        raise ValueError(f"the draft {draft.source!r} and the target {target.source!r} have different tokenizers "
                         f"({len(differ)} ids differ: {shown}); {ADVICE}")
    vocab = VocabMap.intersect(target.keys, target.logits, draft.keys, draft.logits)
    if vocab.fraction < MIN_SHARED:
        raise ValueError(
            f"the draft {draft.source!r} has another tokenizer than the target {target.source!r} and they share "
            f"too little to speculate: {vocab.describe()}, below the {MIN_SHARED:.0%} a draft with another "
            f"tokenizer needs; {ADVICE}")
    log.info("the draft %s has another vocabulary than the target %s: drafting over the tokens they share "
             "(%s)", draft.source, target.source, vocab.describe())
    return vocab


def _differing_ids(target: VocabularyFacts, draft: VocabularyFacts) -> list[int]:
    """Ids both tokenizers define with different strings or keys (none without both tokenizers)."""
    differ: set[int] = set()
    for ours, theirs in ((target.tokens, draft.tokens), (target.keys, draft.keys)):
        if ours is not None and theirs is not None:
            differ.update(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                          if a is not None and b is not None and a != b)
    return sorted(differ)
