"""Medusa heads in FasterDecoding's public layout, with random weights, for a target directory.

`write_medusa_head(directory, target_dir, heads, layers)` writes config.json
(`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`; the base model's sizes
only with `sizes=True`) and `medusa_lm_head.safetensors` (or `.pt` with `pt=True`) under the
public names `{k}.{l}.linear.weight` / `.bias` (l < layers) and `{k}.{layers}.weight`.
`copy_lm_head=True` gives every head the target's own lm_head behind blocks that add nothing
(zero weights and biases): each head drafts the target's greedy next token again, which the
target accepts wherever it repeats a token. `reference_medusa` is the format's forward in
plain torch from the files alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's lm_head [V, H] (its embedding when tied)."""
    tensors = load_file(str(target_dir / "model.safetensors"))
    return tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])


def write_medusa_head(directory: Path, target_dir: Path, heads: int, layers: int = 1, *, seed: int = 0,
                      std: float = 0.2, sizes: bool = False, pt: bool = False, copy_lm_head: bool = False,
                      hidden_size: int | None = None, vocab_size: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    h, v = hidden_size or target["hidden_size"], vocab_size or target["vocab_size"]
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": str(target_dir)}
    if sizes:
        config.update(hidden_size=h, vocab_size=v)
    gen = torch.Generator().manual_seed(seed)
    lm_head = target_lm_head(target_dir) if copy_lm_head else None
    t: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for layer in range(layers):
            scale = 0.0 if copy_lm_head else std
            t[f"{k}.{layer}.linear.weight"] = torch.randn(h, h, generator=gen) * scale
            t[f"{k}.{layer}.linear.bias"] = torch.randn(h, generator=gen) * scale
        t[f"{k}.{layers}.weight"] = lm_head.clone() if lm_head is not None else torch.randn(v, h, generator=gen) * std
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if pt:
        torch.save(t, directory / "medusa_lm_head.pt")
    else:
        save_file({k: x.contiguous() for k, x in t.items()}, str(directory / "medusa_lm_head.safetensors"))
    return directory


def reference_medusa(directory: Path, hidden: torch.Tensor) -> torch.Tensor:
    """The heads' logits from the files: hidden [A, H] (the target's final normed states) ->
    [K, A, V], head k = its blocks x + silu(W x + b), then its lm_head."""
    cfg = json.loads((directory / "config.json").read_text())
    file = directory / "medusa_lm_head.safetensors"
    w = load_file(str(file)) if file.exists() else torch.load(directory / "medusa_lm_head.pt", weights_only=True)
    out = []
    for k in range(cfg["medusa_num_heads"]):
        x = hidden
        for layer in range(cfg["medusa_num_layers"]):
            x = x + F.silu(x @ w[f"{k}.{layer}.linear.weight"].T + w[f"{k}.{layer}.linear.bias"])
        out.append(x @ w[f"{k}.{cfg['medusa_num_layers']}.weight"].T)
    return torch.stack(out)
