"""The project's own small draft/target Llama pair, trained on the Python standard library.

`infer.corpus` picks and splits the training files (the bench reads its validation
split too), `bpe` trains the byte-level BPE tokenizer, `presets` holds the shapes and
settings, `trainer` / `train` train both models, `evaluate` measures the pair (losses, the
paper's alpha, greedy agreement, n-gram baselines) and writes the model cards, `verify`
checks shipped checkpoints. The trained checkpoints ship in the package's
`infer/demo_models/{target,draft}`, beside the target's EAGLE-3 head in
`infer/demo_models/eagle3` (`eagle_head` trains it, `eagle_eval` compares it with the
draft); `infer.engine.loading.demo_model_path(role)` finds them. This code is not part of
the installed package: from a checkout, `PYTHONPATH=src:scripts python -m demo_pair` runs
the whole pipeline (`--eagle-head`: the head too).
"""

from __future__ import annotations

ROLES = ("target", "draft")  # the models `train` makes
