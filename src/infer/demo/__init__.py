"""The project's own small draft/target Llama pair, trained on the Python standard library.

`corpus` picks and splits the training files, `bpe` trains the byte-level BPE tokenizer,
`presets` holds the shapes and settings, `trainer` / `train` train both models,
`evaluate` measures the pair (losses, the paper's alpha, greedy agreement, n-gram
baselines) and writes the model cards, `verify` checks shipped checkpoints. The trained
checkpoints ship in `infer/demo_models/{target,draft}`, beside the target's EAGLE-3 head in
`infer/demo_models/eagle3` (`eagle_head` trains it, `eagle_eval` compares it with the draft);
`python -m infer.demo` runs the whole pipeline (`--eagle-head`: the head too), and
`demo_model_path(role)` finds the shipped directories.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODELS_DIR = Path(__file__).resolve().parent.parent / "demo_models"
ROLES = ("target", "draft")
SHIPPED = (*ROLES, "eagle3")  # the pair and the target's EAGLE-3 head


def demo_model_path(role: str = "target") -> Path:
    """Directory of the shipped demo `role` ("target", "draft" or "eagle3": the target's
    EAGLE-3 head) in Hugging Face layout."""
    if role not in SHIPPED:
        raise ValueError(f"role must be one of {SHIPPED}, got {role!r}")
    path = DEMO_MODELS_DIR / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo {role} is not installed at {path}: train it with "
            "`PYTHONPATH=src python -m infer.demo --out src/infer/demo_models --eagle-head` "
            "(see scripts/demo_pair/README.md)")
    return path
