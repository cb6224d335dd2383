"""Medusa head checkpoints in FasterDecoding's public layout: reading and loading.

A directory (or hub id) holds config.json (`medusa_num_heads`, `medusa_num_layers`) and
`medusa_lm_head.safetensors` or `.pt`: `{k}.{l}.linear.weight` [H, H] and `.bias` [H] for l < L,
and `{k}.{L}.weight` [V, H] (a `medusa_head.` prefix is accepted).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from infer.models.config import ModelConfig
from infer.models.loading.readers import resolve_model_path
from infer.models.medusa import MedusaConfig, MedusaHead, build_head

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
HUB_FILES = ["config.json", *WEIGHT_FILES]
_NAME = re.compile(r"^(?:medusa_heads?\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def medusa_directory(name_or_path: str) -> Path:
    """A local directory, or a hub id's snapshot of config.json and the weight file."""
    return resolve_model_path(name_or_path, HUB_FILES)


def weight_file(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{str(directory)!r} holds neither {' nor '.join(WEIGHT_FILES)}: a Medusa head "
                            "directory holds config.json and the heads' weights in one of them")


def read_medusa_config(name_or_path: str) -> MedusaConfig:
    """The heads' config from config.json, sizes it lacks from the safetensors header."""
    directory = medusa_directory(name_or_path)
    source = f"Medusa heads {str(directory)!r}"
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} has no config.json: a Medusa head directory holds config.json "
                                f"(medusa_num_heads, medusa_num_layers) and {' or '.join(WEIGHT_FILES)}")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in raw]
    if missing:
        raise ValueError(f"{source}: config.json lacks {missing}: is this a Medusa head directory?")
    spec = MedusaConfig(raw["medusa_num_heads"], raw["medusa_num_layers"], raw.get("hidden_size"),
                        raw.get("vocab_size"), source)
    file = weight_file(directory)
    if (spec.hidden_size is None or spec.vocab_size is None) and file.suffix == ".safetensors":
        vocab, hidden = _head_shape(_header_shapes(file), spec)
        spec = dataclasses.replace(spec, hidden_size=spec.hidden_size or hidden, vocab_size=spec.vocab_size or vocab)
    return spec


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def _head_shape(shapes: dict[str, tuple[int, ...]], spec: MedusaConfig) -> tuple[int, int]:
    """(V, H) of head 0's lm_head, `0.{L}.weight`."""
    for key, shape in shapes.items():
        match = _NAME.match(key)
        if match and match.group(1, 2) == ("0", str(spec.num_layers)) and match.group(3) == "weight":
            if len(shape) != 2:
                raise ValueError(f"{spec.source}: tensor {key!r} has shape {shape}, a [vocab, hidden] matrix expected")
            return shape[0], shape[1]
    raise ValueError(f"{spec.source} has no tensor 0.{spec.num_layers}.weight (head 0's lm_head): check "
                     "medusa_num_layers in config.json")


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """name -> CPU tensor of the weight file."""
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(file))
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{str(file)!r} is not a state dict of tensors (name -> tensor)")
    return state


def load_medusa_head(name_or_path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                     quantization: str | None = None) -> MedusaHead:
    """The heads in `dtype` on `device` (`quantization`: their linears stored so). Checks the config
    against the target before reading weights, and each tensor's name and shape; raises ValueError."""
    spec = read_medusa_config(name_or_path)
    spec.check_target(target)
    tensors = read_tensors(weight_file(medusa_directory(name_or_path)))
    if spec.hidden_size is None or spec.vocab_size is None:  # (a .pt file: its shapes, now they are read)
        vocab, hidden = _head_shape({k: tuple(v.shape) for k, v in tensors.items()}, spec)
        spec = dataclasses.replace(spec, hidden_size=hidden, vocab_size=vocab)
        spec.check_target(target)
    head = build_head(spec, dtype, device, quantization)
    _load(head, tensors)
    return head.eval().requires_grad_(False)


def _load(head: MedusaHead, tensors: dict[str, torch.Tensor]) -> None:
    spec, layers = head.spec, head.linears()
    seen: set[str] = set()
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        k, l, leaf = (int(match.group(1)), int(match.group(2)), match.group(3)) if match else (-1, -1, "")
        key = f"{k}.{l}.linear" if leaf.startswith("linear.") else f"{k}.{l}"
        layer = layers.get(key)
        if layer is None or (layer.bias is None) != (leaf == "weight"):
            raise ValueError(f"{spec.source}: unexpected tensor {name!r}: {spec.num_heads} heads of "
                             f"{spec.num_layers} blocks hold {{k}}.{{l}}.linear.weight / .bias (l < {spec.num_layers}) "
                             f"and {{k}}.{spec.num_layers}.weight (k < {spec.num_heads}); check config.json")
        bias = leaf.endswith("bias")
        want = (layer.out_features,) if bias else (layer.out_features, layer.in_features)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{spec.source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                             f"{want}")
        if bias:
            layer.load_bias(tensor.to(layer.bias.dtype), None, name)
        else:
            layer.load_rows(tensor, None, name)
        seen.add(f"{key}.{leaf.rpartition('.')[2]}")
    missing = [f"{key}.{p}" for key, layer in layers.items() for p in ("weight", "bias")
               if (p == "weight" or layer.bias is not None) and f"{key}.{p}" not in seen]
    if missing:
        raise ValueError(f"{spec.source} is missing tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''}: "
                         "the weight file is incomplete, or config.json names more heads or blocks than it holds")
