"""The tiny models the engine fuzzer runs on (helpers/fuzz.py), made once per directory.

`FuzzModels.build(root, target=None)` writes (or reuses) the target (checkpoint "a" of
helpers.checkpoints, or the directory given), three draft models of its vocabulary and
a draft of another tokenizer, two EAGLE heads and Medusa heads for it, and names each by the
role `Case.engine["draft"]` uses: "self" (the target itself: every draft accepted), "random"
(unrelated weights, one layer: drafts nearly always rejected), "near" (the target's weights
with noise: some accepted), "foreign" (one random layer over a vocabulary trained on other
text: drafts over the shared tokens, helpers.foreign_vocab), "eagle" and "eagle3" (random
heads, helpers.eagle_heads), "medusa" (six heads, each the target's own lm_head:
helpers.medusa_heads); and `vocab_table`, a reduced draft vocabulary (the target's even ids
and its end-of-sequence id) for `spec_draft_vocab`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers.checkpoints import make_checkpoint
from helpers.eagle_heads import write_head
from helpers.foreign_vocab import foreign_draft
from helpers.medusa_heads import write_medusa_head
from infer.speculative.draft_vocab import DraftVocab
from safetensors.torch import load_file, save_file

NEAR_NOISE = 0.05  # the near draft's weights: the target's plus N(0, NEAR_NOISE)


@dataclass(frozen=True)
class FuzzModels:
    target: Path
    drafts: dict[str, Path]  # role -> directory (a draft model or an EAGLE head)
    vocab_table: Path  # a reduced draft vocabulary of the target's (speculative/draft_vocab.py)

    @classmethod
    def build(cls, root: str | Path, target: Path | None = None) -> FuzzModels:
        root = Path(root)
        done = root / "ready"
        target = target or root / "target"
        paths = {"self": target, "random": root / "random", "near": root / "near", "foreign": root / "foreign",
                 "eagle": root / "eagle", "eagle3": root / "eagle3", "medusa": root / "medusa"}
        table = root / "draft_vocab.json"
        if done.exists() and table.exists() and all(p.exists() for p in paths.values()):
            return cls(target, paths, table)
        if not (target / "config.json").exists():
            make_checkpoint(target, variant="a")
        make_checkpoint(paths["random"], variant="a", seed=123, num_hidden_layers=1)
        _noisy_copy(target, paths["near"])
        foreign_draft(paths["foreign"])
        write_head(paths["eagle"], target, "eagle", fc_bias=True)
        write_head(paths["eagle3"], target, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1])
        write_medusa_head(paths["medusa"], target, 6, 1, copy_lm_head=True)  # (spec_length up to 6)
        _half_vocabulary(target, table)
        done.write_text("")
        return cls(target, paths, table)

    def draft(self, role: str) -> Path:
        if role not in self.drafts:
            raise ValueError(f"unknown draft role {role!r}; choose one of {sorted(self.drafts)}")
        return self.drafts[role]


def _half_vocabulary(target: Path, path: Path) -> None:
    """A draft vocabulary of the target's even ids and its end-of-sequence id."""
    config = json.loads((target / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    ids = (eos, *(i for i in range(0, vocab, 2) if i != eos))
    DraftVocab(ids, vocab, "even ids", 0, 0.0).save(path)


def _noisy_copy(target: Path, directory: Path) -> None:
    """The target's checkpoint with Gaussian noise on every weight (a fixed seed)."""
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(target, directory)
    gen = torch.Generator().manual_seed(7)
    tensors = load_file(str(target / "model.safetensors"))
    noisy = {k: (v + NEAR_NOISE * torch.randn(v.shape, generator=gen)).to(v.dtype).contiguous()
             for k, v in tensors.items()}
    save_file(noisy, str(directory / "model.safetensors"), metadata={"format": "pt"})
