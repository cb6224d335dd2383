"""Checkpoint formats as readers: each gives a `ModelConfig` and Hugging Face named tensors.

`open_reader(name_or_path, load_format)` picks one:

- `SafetensorsReader`: a directory in Hugging Face layout (config.json, model.safetensors or
  the shards model.safetensors.index.json lists), local or fetched from the hub by id.
  Tensors are read one at a time; with a tensor-parallel shard only the shard's part of
  each (safetensors `get_slice`: the rest is never read).
- `GGUFReader`: a llama.cpp file (models/gguf): config from its metadata, tensors
  dequantized into the model's dtype and renamed to Hugging Face names.
- `DummyReader`: random weights of a config's shapes (normal, std 0.02; norm weights 1, the
  final norm's DUMMY_LOGIT_GAIN), drawn from a fixed seed as whole tensors in one order, so
  a tensor-parallel rank keeping its part of each holds exactly the one-process dummy model.

The loader (models/loader.py) feeds any reader's tensors to one build function.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import huggingface_hub
import torch
from safetensors import safe_open
from tqdm import tqdm

from infer.models.config import ModelConfig
from infer.models.llama import LlamaForCausalLM, fused_to_hf, norm_weights
from infer.models.quantization import FP8_DTYPE, checkpoint_quantization
from infer.models.shard import ModelShard, read_part, shard_tensors

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]
PROGRESS_MIN_BYTES = 1 << 30  # show a progress bar for loads above 1 GiB
GGUF_PROGRESS_MIN_BYTES = 1 << 24  # dequantizing is slow: a bar for GGUF files above 16 MiB
DUMMY_LOGIT_GAIN = 20.0

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")


class WeightReader(Protocol):
    """A checkpoint: its config, and its tensors under Hugging Face names."""

    config: ModelConfig
    config_dtype: str | None  # the dtype the checkpoint names ("auto" follows it), if any
    stored_quantization: str | None  # the quantization its tensors are stored in

    def tensors(self, device: torch.device, dtype: torch.dtype,
                shard: ModelShard | None) -> Iterable[tuple[str, torch.Tensor]]:
        """(hf_name, tensor on `device`) one at a time, in `dtype` (stored FP8 weights and
        their scales keep theirs); with a `shard`, only its part of each tensor."""
        ...


@dataclass
class SafetensorsReader:
    directory: Path
    config: ModelConfig
    config_dtype: str | None
    stored_quantization: str | None

    @classmethod
    def open(cls, name_or_path: str) -> SafetensorsReader:
        directory = resolve_model_path(name_or_path)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{str(directory)!r} has no config.json: a model directory must be in Hugging Face "
                "layout (config.json + model.safetensors or sharded model-*.safetensors)")
        try:
            with open(config_path, encoding="utf-8") as f:
                raw: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path} is not valid JSON ({exc}); re-download or re-save it") from exc
        try:
            config = ModelConfig.from_hf_dict(raw)
        except KeyError as exc:
            raise ValueError(f"{config_path} lacks the required field {exc.args[0]!r}") from exc
        return cls(directory, config, raw.get("torch_dtype") or raw.get("dtype"), checkpoint_quantization(raw))

    def tensors(self, device: torch.device, dtype: torch.dtype,
                shard: ModelShard | None) -> Iterator[tuple[str, torch.Tensor]]:
        files = find_weight_files(self.directory)
        total_bytes = sum(f.stat().st_size for f in files)
        names = []
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                names.append(list(f.keys()))
        show = total_bytes > PROGRESS_MIN_BYTES
        with tqdm(total=sum(map(len, names)), desc="loading weights", unit="tensor", disable=not show) as bar:
            for path, keys in zip(files, names, strict=True):
                with safe_open(str(path), framework="pt", device=_safetensors_device(device)) as f:
                    for key in keys:
                        if shard is None:
                            tensor = f.get_tensor(key)
                        else:
                            part = f.get_slice(key)
                            tensor = read_part(part, shard.part(key, tuple(part.get_shape())))
                        # FP8 weights and their float32 scales keep their dtype (the layers convert)
                        keep = tensor.dtype == FP8_DTYPE or key.endswith("_scale")
                        yield key, tensor if keep else tensor.to(dtype)
                        bar.update(1)


@dataclass
class GGUFReader:
    path: Path
    gguf: Any  # infer.models.gguf.reader.GGUFFile (the gguf library loads only for GGUF files)
    config: ModelConfig
    config_dtype: str | None = None
    stored_quantization: str | None = None  # dequantized as read: re-quantized only if asked

    @classmethod
    def open(cls, path: Path) -> GGUFReader:
        from infer.models.gguf.config import config_from_gguf
        from infer.models.gguf.reader import GGUFFile
        from infer.models.gguf.weights import check_tensors
        gguf = GGUFFile.open(path)
        config = config_from_gguf(gguf)
        check_tensors(gguf)  # before any memory is taken for the model
        return cls(path, gguf, config)

    def tensors(self, device: torch.device, dtype: torch.dtype,
                shard: ModelShard | None) -> Iterable[tuple[str, torch.Tensor]]:
        from infer.models.gguf.weights import iter_hf_tensors
        show = self.path.stat().st_size > GGUF_PROGRESS_MIN_BYTES
        tensors = iter_hf_tensors(self.gguf, self.config, device, dtype, progress=show)
        return tensors if shard is None else shard_tensors(tensors, shard)


@dataclass
class DummyReader:
    config: ModelConfig
    config_dtype: str | None = None
    stored_quantization: str | None = None
    seed: int = 0
    std: float = 0.02

    def tensors(self, device: torch.device, dtype: torch.dtype,
                shard: ModelShard | None) -> Iterable[tuple[str, torch.Tensor]]:
        tensors = dummy_hf_tensors(self.config, dtype, device, self.seed, self.std)
        return tensors if shard is None else shard_tensors(tensors, shard)


def dummy_hf_tensors(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole model's dummy weights as Hugging Face named tensors, one at a time: normal(0,
    std) matrices and biases, RMSNorm weights 1 except the final norm's (DUMMY_LOGIT_GAIN).

    A final-norm gain of 20 scales the logits (std about 20 instead of 1): next-token
    distributions are peaked, so greedy choices are not decided by bf16 rounding, yet two
    different dummy models still disagree (a random draft accepts ~nothing)."""
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    norms = norm_weights(meta)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in meta.named_parameters():
        tensor = torch.empty(param.shape, dtype=dtype, device=device)
        if param is meta.model.norm.weight:
            tensor.fill_(DUMMY_LOGIT_GAIN)
        elif id(param) in norms:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=gen)
        yield from fused_to_hf(name, tensor, config)


def resolve_model_path(name_or_path: str) -> Path:
    """Local directory (as is) or hub id "org/name" (downloaded) -> local directory."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} is a file but not a GGUF file; pass the directory that "
            "holds config.json and the *.safetensors weights, or a llama.cpp .gguf file")
    if not _HUB_ID.match(name_or_path):
        raise FileNotFoundError(
            f"model directory {name_or_path!r} does not exist; pass a local directory in "
            "Hugging Face layout (config.json + *.safetensors) or a hub id like 'org/name'")
    try:
        local = huggingface_hub.snapshot_download(name_or_path, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # offline, DNS, gated or unknown repo: all mean "cannot fetch"
        raise FileNotFoundError(
            f"{name_or_path!r} is not a local directory and could not be fetched from the Hugging "
            f"Face hub (hub unreachable, or the repo is unknown or gated: {type(exc).__name__}: "
            f"{exc}). Pass a local directory in Hugging Face layout (config.json + "
            "*.safetensors) instead") from exc
    return Path(local)


def find_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, model.safetensors, or *.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return _index_shards(index)
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if found:
        return found
    hint = " (only PyTorch .bin/.pth files found: convert them to safetensors)" if (
        any(directory.glob("*.bin")) or any(directory.glob("*.pth"))) else ""
    raise FileNotFoundError(
        f"no weight files in {str(directory)!r}: expected model.safetensors or "
        f"model.safetensors.index.json with its shards{hint}; use load_format='dummy' for "
        "random weights")


def _index_shards(index: Path) -> list[Path]:
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map: the sharded checkpoint index is corrupt")
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{index.name} references missing shard file(s) {missing}: the download is "
            "incomplete; fetch the missing shards or re-save the model")
    return shards


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type
