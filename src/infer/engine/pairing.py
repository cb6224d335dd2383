"""Whether a draft model can speculate for a target, decided from their files alone.

Speculative decoding compares the draft's and the target's distributions id by id, so the
two must index the same vocabulary: the same number of logits, and the same token behind
each id. `check_pair` compares what the config files (or GGUF metadata) and the tokenizer
files say, before either model's weights are read; engine/loading.py calls it. The draft's
own stop ids do not matter: the target's decide when a request ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_SHOWN = 3  # differing ids quoted in an error


@dataclass(frozen=True, slots=True)
class VocabularyFacts:
    """One model's side of the comparison, read without loading weights."""

    source: str  # the model's path or name, as messages show it
    logits: int  # the model's vocabulary size: rows of its embedding, width of its logits
    tokens: Sequence[str | None] | None  # its tokenizer's string for each id; None: no tokenizer

    def __post_init__(self) -> None:
        if self.logits <= 0:
            raise ValueError(f"{self.source}: a vocabulary of {self.logits} ids is not a model's")


def check_pair(target: VocabularyFacts, draft: VocabularyFacts) -> None:
    """Raise ValueError, saying what to do, unless `draft` can propose tokens for `target`.

    Ids a tokenizer does not define (padding rows of a larger embedding) are not compared;
    every id both tokenizers define must be the same string.
    """
    advice = ("choose a draft trained with the target's tokenizer (a smaller model of the same family, "
              "e.g. Qwen2.5-0.5B-Instruct for Qwen2.5-3B-Instruct), or speculate without a draft model "
              "(speculative_method='ngram' or 'prompt_lookup')")
    if draft.logits != target.logits:
        raise ValueError(
            f"the draft {draft.source!r} has a vocabulary of {draft.logits} ids and the target "
            f"{target.source!r} {target.logits}: speculative decoding needs the same vocabulary size; {advice}")
    if target.tokens is None or draft.tokens is None:
        return
    differ = [i for i, (a, b) in enumerate(zip(target.tokens, draft.tokens, strict=False))
              if a is not None and b is not None and a != b]
    if differ:
        shown = ", ".join(f"id {i} is {draft.tokens[i]!r} in the draft and {target.tokens[i]!r} in the target"
                          for i in differ[:_SHOWN])
        raise ValueError(
            f"the draft {draft.source!r} and the target {target.source!r} have different tokenizers "
            f"({len(differ)} of {min(len(target.tokens), len(draft.tokens))} ids differ: {shown}); {advice}")
