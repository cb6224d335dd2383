"""VocabMap: the tokens a draft with another tokenizer shares with its target (token-level
intersection: Timor et al., ICML 2025, arXiv 2502.05202).

Tokens are matched by what they stand for (`tokenization.token_keys`), a key's lowest id its canonical id; the draft
proposes canonical shared ids (`draft_to_target`, `probs_to_target`) and reads target tokens through `expand`.
docs/architecture.md, "A draft model with another vocabulary"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from infer.tokenization.token_keys import TokenKey


@dataclass(frozen=True)
class VocabMap:
    draft_to_target: tuple[int, ...]  # [V_d] the target id each draft id is proposed as; -1: not shared
    target_to_draft: tuple[int, ...]  # [V_t] the draft id a target token is fed as; -1: expanded instead
    target_bytes: tuple[bytes | None, ...]  # [V_t] each target text token's bytes (None: special or unknown)
    pieces: Mapping[bytes, int]  # the draft's text tokens by their bytes (canonical ids)
    sizes: tuple[int, int]  # distinct keys of the target's and the draft's vocabulary
    longest: int  # bytes of the draft's longest text token
    expansions: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def intersect(cls, target_keys: Sequence[TokenKey | None], target_logits: int,
                  draft_keys: Sequence[TokenKey | None], draft_logits: int) -> VocabMap:
        """The map of two vocabularies: each model's keys per id (ids past its logits ignored,
        ids of its logits past its keys unknown) and its number of logits."""
        target, draft = _canonical(target_keys, target_logits), _canonical(draft_keys, draft_logits)
        to_target = [-1] * draft_logits
        for key, x in draft.items():
            to_target[x] = target.get(key, -1)
        keys = [*target_keys[:target_logits], *[None] * max(0, target_logits - len(target_keys))]
        to_draft = tuple(-1 if key is None else draft.get(key, -1) for key in keys)
        pieces = {key: x for key, x in draft.items() if isinstance(key, bytes)}
        return cls(tuple(to_target), to_draft, tuple(key if isinstance(key, bytes) else None for key in keys),
                   pieces, (len(target), len(draft)), max(map(len, pieces), default=0))

    @property
    def shared(self) -> int:
        """Tokens the draft can propose."""
        return sum(t >= 0 for t in self.draft_to_target)

    @property
    def fraction(self) -> float:
        """Shared tokens over the smaller vocabulary's distinct tokens."""
        return self.shared / max(1, min(self.sizes))

    def describe(self) -> str:
        shared = self.shared
        return (f"{shared} shared token{'' if shared == 1 else 's'}, {self.fraction:.1%} of the smaller vocabulary "
                f"({min(self.sizes)} tokens; target {self.sizes[0]}, draft {self.sizes[1]})")

    def draft_allowed(self) -> torch.Tensor:
        """[V_d] bool: the draft's shared (proposable) ids."""
        return torch.tensor([t >= 0 for t in self.draft_to_target], dtype=torch.bool)

    def probs_source(self) -> torch.Tensor:
        """[V_t] long: the draft id proposed as each target id, -1 for none (`probs_to_target`)."""
        source = torch.full((len(self.target_to_draft),), -1, dtype=torch.long)
        for x, t in enumerate(self.draft_to_target):
            if t >= 0:
                source[t] = x
        return source

    def longest_expansion(self) -> int:
        """The most draft ids one target token stands for (at least 1); cuts every unshared token: ask once."""
        return max([1, *(len(greedy_pieces(raw, self.pieces, self.longest))
                         for x, raw in zip(self.target_to_draft, self.target_bytes, strict=True)
                         if x < 0 and raw is not None)])

    def expand(self, target_id: int) -> tuple[int, ...]:
        """The draft ids standing for one target token: a shared one's id, another text token's bytes
        cut into the longest draft tokens (`greedy_pieces`), a special token it lacks as nothing."""
        known = self.expansions.get(target_id)
        if known is not None:
            return known
        x = self.target_to_draft[target_id]
        raw = self.target_bytes[target_id]
        out = (x,) if x >= 0 else () if raw is None else greedy_pieces(raw, self.pieces, self.longest)
        self.expansions[target_id] = out
        return out


def probs_to_target(probs: torch.Tensor, source: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
    """q over the draft's ids [M, V_d] -> over the target's [M, V_t] (0 where no id is proposed as t).
    source [V_t]: `VocabMap.probs_source` clamped to 0; missing [V_t]: where it was -1 (on q's device)."""
    return probs.index_select(-1, source).masked_fill_(missing, 0.0)  # [M, V_t]


def greedy_pieces(raw: bytes, pieces: Mapping[bytes, int], longest: int) -> tuple[int, ...]:
    """`raw` cut left to right into the longest byte strings `pieces` holds (none longer
    than `longest`); a byte no piece starts with is skipped."""
    out: list[int] = []
    i = 0
    while i < len(raw):
        for end in range(min(len(raw), i + longest), i, -1):
            x = pieces.get(raw[i:end])
            if x is not None:
                out.append(x)
                i = end
                break
        else:
            i += 1
    return tuple(out)


def _canonical(keys: Sequence[TokenKey | None], logits: int) -> dict[TokenKey, int]:
    """Each key's lowest id below `logits` (empty keys stand for nothing)."""
    out: dict[TokenKey, int] = {}
    for i, key in enumerate(keys[:logits]):
        if key and key not in out:
            out[key] = i
    return out
