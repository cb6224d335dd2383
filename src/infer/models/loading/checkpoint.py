"""Save a model as a Hugging Face Llama checkpoint directory.

`save_checkpoint` writes config.json, generation_config.json and safetensors weights (sharded
with an index above `max_shard_bytes`; tied embeddings stored once). The result loads with
`load_model` and with `transformers.LlamaForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from infer.models.llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class _Shard:
    names: list[str] = field(default_factory=list)
    nbytes: int = 0


def save_checkpoint(
    model: LlamaForCausalLM,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write `model` to `directory` in Hugging Face layout; returns the directory."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    first = next(model.parameters())
    dtype = dtype or first.dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be saved; choose one of {list(_DTYPE_NAMES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shapes = {name: t for name, t in model.hf_state_dict()}  # views, no copies yet
    shards = plan_shards({n: t.numel() * dtype.itemsize for n, t in shapes.items()}, max_shard_bytes)
    names = _shard_file_names(len(shards))
    for stale in directory.glob("model-*-of-*.safetensors"):  # from an earlier save
        if stale.name not in names:
            stale.unlink()
    for shard, file_name in zip(shards, names, strict=True):
        tensors = {n: shapes[n].to(device="cpu", dtype=dtype).clone().contiguous() for n in shard.names}
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        _write_index(directory, shards, names)
    else:
        (directory / INDEX_FILE).unlink(missing_ok=True)
    config = {**model.config.to_hf_dict(), "torch_dtype": _DTYPE_NAMES[dtype]}
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", _generation_config(model, generation_config))
    return directory


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[_Shard]:
    """Greedy in-order packing of tensors (name -> bytes) into shards of at most max bytes
    (a larger tensor gets a shard of its own)."""
    shards = [_Shard()]
    for name, nbytes in sizes.items():
        current = shards[-1]
        if current.names and current.nbytes + nbytes > max_shard_bytes:
            current = _Shard()
            shards.append(current)
        current.names.append(name)
        current.nbytes += nbytes
    return shards


def _shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_index(directory: Path, shards: list[_Shard], names: list[str]) -> None:
    weight_map = {t: file_name for shard, file_name in zip(shards, names, strict=True) for t in shard.names}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
    _write_json(directory / INDEX_FILE, index)
    (directory / SINGLE_FILE).unlink(missing_ok=True)


def _generation_config(model: LlamaForCausalLM, extra: dict[str, Any] | None) -> dict[str, Any]:
    eos = list(model.config.eos_token_ids)
    gen: dict[str, Any] = {
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    return {**gen, **(extra or {})}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
