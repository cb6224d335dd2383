"""The project's own small draft/target Llama pair, trained on the Python standard library.

`corpus` picks and splits the training files, `bpe` trains the byte-level BPE tokenizer,
`presets` holds the shapes and settings, `trainer` / `train` train both models,
`evaluate` measures the pair (losses, the paper's alpha, greedy agreement, n-gram
baselines) and writes the model cards, `verify` checks shipped checkpoints. The trained
checkpoints ship in `infer/demo_models/{target,draft}`; `python -m infer.demo` runs the
whole pipeline, and `demo_model_path(role)` finds the shipped directories.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODELS_DIR = Path(__file__).resolve().parent.parent / "demo_models"
ROLES = ("target", "draft")


def demo_model_path(role: str = "target") -> Path:
    """Directory of the shipped demo `role` ("target" or "draft") in Hugging Face layout."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    path = DEMO_MODELS_DIR / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo {role} is not installed at {path}: train it with "
            "`PYTHONPATH=src python -m infer.demo --out src/infer/demo_models` "
            "(see scripts/demo_pair/README.md)")
    return path
