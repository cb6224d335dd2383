"""Checkpoint formats as readers: each gives a `ModelConfig` and Hugging Face named tensors.

`SafetensorsReader` (a Hugging Face directory, local or from the hub), `GGUFReader` (a llama.cpp
file, gguf/) and `DummyReader` (seeded random weights, drawn whole so a rank's part matches the
one-process model's). A reader's `int_layouts` are the layers its integer codes fill as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import huggingface_hub
import torch
from safetensors import safe_open
from tqdm import tqdm

from infer.models.config import ModelConfig
from infer.models.layers.fp8 import FP8_DTYPE
from infer.models.layers.int_quant import PackedRows
from infer.models.layers.shard import PartFn, read_part, shard_tensors
from infer.models.llama import LlamaForCausalLM, fused_to_hf, norm_weights
from infer.models.loading.layouts import LayerLayouts, projection_layouts
from infer.models.loading.quantized import IntFormat, checkpoint_quantization, int_format

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
    int_layouts: LayerLayouts  # layers its integer codes fill as they are

    def tensors(self, device: torch.device, dtype: torch.dtype, parts: PartFn | None,
                layouts: LayerLayouts) -> Iterable[tuple[str, torch.Tensor | PackedRows]]:
        """(hf_name, tensor on `device`) one at a time, in `dtype` (FP8 weights and scales keep theirs;
        `PackedRows` for the layers in `layouts`); with `parts`, only the part of each tensor it names."""
        ...


@dataclass
class SafetensorsReader:
    directory: Path
    config: ModelConfig
    config_dtype: str | None
    stored_quantization: str | None
    int_format: IntFormat | None = None
    int_layouts: LayerLayouts = field(default_factory=dict)

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
        fmt = int_format(raw)
        reader = cls(directory, config, raw.get("torch_dtype") or raw.get("dtype"), checkpoint_quantization(raw), fmt)
        if fmt is not None:
            reader.int_layouts = projection_layouts(config, fmt.layout)
            _check_int_tensors(fmt, reader.int_layouts, _tensor_names(find_weight_files(directory)))
        return reader

    def tensors(self, device: torch.device, dtype: torch.dtype, parts: PartFn | None,
                layouts: LayerLayouts) -> Iterator[tuple[str, torch.Tensor | PackedRows]]:
        files = find_weight_files(self.directory)
        names = _tensor_names(files)
        if self.int_format is not None and parts is not None:
            raise ValueError(f"tensor parallelism does not split {self.int_format.method} checkpoints yet: load "
                             "it with tensor_parallel_size=1, or the bf16 model with quantization='int4'")
        raw = self._read(files, names, device, dtype, parts)
        return raw if self.int_format is None else _int_layers(raw, self.int_format, names)

    def _read(self, files: list[Path], names: list[list[str]], device: torch.device, dtype: torch.dtype,
              parts: PartFn | None) -> Iterator[tuple[str, torch.Tensor]]:
        show = sum(f.stat().st_size for f in files) > PROGRESS_MIN_BYTES
        with tqdm(total=sum(map(len, names)), desc="loading weights", unit="tensor", disable=not show) as bar:
            for path, keys in zip(files, names, strict=True):
                with safe_open(str(path), framework="pt", device=_safetensors_device(device)) as f:
                    for key in keys:
                        if parts is None:
                            tensor = f.get_tensor(key)
                        else:
                            part = f.get_slice(key)
                            tensor = read_part(part, parts(key, tuple(part.get_shape())))
                        # FP8 weights, scales and integer tensors keep their dtype (the layers convert)
                        keep = tensor.dtype == FP8_DTYPE or key.endswith("_scale") or not tensor.is_floating_point() \
                            or (self.int_format is not None and key.rpartition(".")[2] in self.int_format.tensor_names())
                        yield key, tensor if keep else tensor.to(dtype)
                        bar.update(1)


def _tensor_names(files: list[Path]) -> list[list[str]]:
    """The tensor names of each weight file (read from the headers)."""
    names = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.append(list(f.keys()))
    return names


def _int_layer_names(fmt: IntFormat, names: list[list[str]]) -> dict[str, set[str]]:
    """Layer name -> the suffixes of its integer tensors present in the files."""
    layers: dict[str, set[str]] = {}
    for key in (k for keys in names for k in keys):
        prefix, _, suffix = key.rpartition(".")
        if suffix in fmt.tensor_names():
            layers.setdefault(prefix, set()).add(suffix)
    return layers


def _check_int_tensors(fmt: IntFormat, layouts: LayerLayouts, names: list[list[str]]) -> None:
    """Raise, before any weight is read, unless every integer layer has its required tensors."""
    present = _int_layer_names(fmt, names)
    for layer in present:
        missing = [s for s in fmt.required() if s not in present[layer]]
        if missing:
            raise ValueError(f"checkpoint is missing {layer}.{missing[0]}: the weight files of this "
                             f"{fmt.method} checkpoint are incomplete (re-download or re-save the model)")
    if not present:
        raise ValueError(f"the {fmt.method} checkpoint's files hold no {fmt.tensor_names()[0]} tensors: its "
                         "config.json does not describe these weights")


def _int_layers(raw: Iterable[tuple[str, torch.Tensor]], fmt: IntFormat,
                names: list[list[str]]) -> Iterator[tuple[str, torch.Tensor | PackedRows]]:
    """`raw` with each integer layer's tensors replaced by one `(<layer>.weight, PackedRows)`."""
    expected = _int_layer_names(fmt, names)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw:
        prefix, _, suffix = key.rpartition(".")
        if prefix not in expected or suffix not in fmt.tensor_names():
            yield key, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if set(parts) == expected[prefix]:
            yield f"{prefix}.weight", fmt.convert(pending.pop(prefix), prefix)


@dataclass
class GGUFReader:
    path: Path
    gguf: Any  # infer.models.gguf.reader.GGUFFile (the gguf library loads only for GGUF files)
    config: ModelConfig
    config_dtype: str | None = None
    stored_quantization: str | None = None  # codes kept where they fit (int_layouts), else dequantized
    int_layouts: LayerLayouts = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path) -> GGUFReader:
        from infer.models.loading.gguf.config import config_from_gguf
        from infer.models.loading.gguf.reader import GGUFFile
        from infer.models.loading.gguf.weights import check_tensors, kept_layouts
        gguf = GGUFFile.open(path)
        config = config_from_gguf(gguf)
        check_tensors(gguf)  # before any memory is taken for the model
        return cls(path, gguf, config, int_layouts=kept_layouts(gguf, config))

    def tensors(self, device: torch.device, dtype: torch.dtype, parts: PartFn | None,
                layouts: LayerLayouts) -> Iterable[tuple[str, torch.Tensor | PackedRows]]:
        from infer.models.loading.gguf.weights import iter_hf_tensors
        show = self.path.stat().st_size > GGUF_PROGRESS_MIN_BYTES
        tensors = iter_hf_tensors(self.gguf, self.config, device, dtype, progress=show, layouts=layouts)
        return tensors if parts is None else shard_tensors(tensors, parts)  # type: ignore[arg-type]


@dataclass
class DummyReader:
    config: ModelConfig
    config_dtype: str | None = None
    stored_quantization: str | None = None
    seed: int = 0
    std: float = 0.02
    int_layouts: LayerLayouts = field(default_factory=dict)

    def tensors(self, device: torch.device, dtype: torch.dtype, parts: PartFn | None,
                layouts: LayerLayouts) -> Iterable[tuple[str, torch.Tensor]]:
        """Dense tensors (layers stored as integers quantize them as they load)."""
        tensors = dummy_hf_tensors(self.config, dtype, device, self.seed, self.std)
        return tensors if parts is None else shard_tensors(tensors, parts)


def dummy_hf_tensors(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole model's dummy weights as Hugging Face named tensors, one at a time: normal(0, std)
    matrices and biases, RMSNorm weights 1, the final norm's DUMMY_LOGIT_GAIN (peaked logits)."""
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


def resolve_model_path(name_or_path: str, patterns: list[str] | None = None) -> Path:
    """Local directory (as is) or hub id "org/name" (downloads files matching `patterns`) -> local directory."""
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
        local = huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns or HUB_PATTERNS)
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
