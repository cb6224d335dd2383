"""Load a Llama checkpoint: hub id, local Hugging Face directory or GGUF file -> (model, config).

    model, config = load_model("meta-llama/Llama-3.2-1B", dtype="bf16", device="cuda")
    model, config = load_model("/models/Llama-3.2-1B")              # local HF layout
    model, config = load_model("/models/Llama-3.2-1B-Q4_K_M.gguf")   # llama.cpp file
    model, config = load_model("dummy:llama-3.2-3b", device="cuda")  # random weights, no files

A name is resolved by `resolve_model_path`: an existing local directory is used as is; an
"org/name" string is fetched with `huggingface_hub.snapshot_download` (config, safetensors,
tokenizer files only); anything else is a FileNotFoundError.

The model is built on the meta device (no initialisation cost), materialised empty on the
target device in the target dtype, then filled from `model.safetensors` or every shard
listed in `model.safetensors.index.json`, one tensor at a time.

A GGUF file (`*.gguf`, see `infer.models.gguf`) gives its config from its metadata and
its weights dequantized into `dtype` ("auto": bfloat16 on CUDA, float32 elsewhere), fed
through the same `load_hf_weights` under Hugging Face names.

`load_format="dummy"` skips weight files and fills the real shapes with small random
weights (normal, std 0.02; norm weights 1) from a fixed seed: for timing, since speed does
not depend on weight values. The shape comes from the directory's config.json, or from
`model_shapes` when the name is "dummy:<shape>" (or a bare shape key such as
"llama-3.1-8b" with load_format="dummy"): "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"
carry the exact configuration values of those released models. With device="meta" a dummy
model is built without any memory (for shape and parameter-count checks).

With a `shard` (models/shard.py; tensor parallelism) the model built is one rank's part,
and of each checkpoint tensor only that part is read (safetensors `get_slice`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
from safetensors import safe_open
from tqdm import tqdm

from infer.models.config import ModelConfig, RopeScaling
from infer.models.gguf.path import is_gguf_path
from infer.models.layers import RMSNorm, Rotary
from infer.models.linear import QUANTIZATIONS, Fp8Linear
from infer.models.llama import LlamaForCausalLM, fused_to_hf
from infer.models.quantization import FP8_DTYPE, checkpoint_quantization
from infer.models.shard import ModelShard, read_part, shard_tensors

DUMMY_PREFIX = "dummy:"
LOAD_FORMATS = ("auto", "safetensors", "dummy")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model"]
PROGRESS_MIN_BYTES = 1 << 30  # show a progress bar for loads above 1 GiB
GGUF_PROGRESS_MIN_BYTES = 1 << 24  # dequantizing is slow: a bar for GGUF files above 16 MiB

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")


def _llama3_shape(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int,
                  tied: bool, rope_factor: float) -> ModelConfig:
    return ModelConfig(
        vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
        head_dim=head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=rope_factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=tied, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))


model_shapes: dict[str, ModelConfig] = {
    "llama-3.2-1b": _llama3_shape(2048, 8192, 16, 32, 64, tied=True, rope_factor=32.0),
    "llama-3.2-3b": _llama3_shape(3072, 8192, 28, 24, 128, tied=True, rope_factor=32.0),
    "llama-3.1-8b": _llama3_shape(4096, 14336, 32, 32, 128, tied=False, rope_factor=8.0),
}


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
    return _download(name_or_path)


def _download(repo_id: str) -> Path:
    try:
        local = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as exc:  # offline, DNS, gated or unknown repo: all mean "cannot fetch"
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory and could not be fetched from the Hugging "
            f"Face hub (hub unreachable, or the repo is unknown or gated: {type(exc).__name__}: "
            f"{exc}). Pass a local directory in Hugging Face layout (config.json + "
            "*.safetensors) instead") from exc
    return Path(local)


def resolve_dtype(dtype: torch.dtype | str, device: torch.device, config_dtype: str | None = None) -> torch.dtype:
    """'auto' -> the config's dtype, else bfloat16 on CUDA / float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        if dtype not in set(DTYPES.values()):
            raise ValueError(f"dtype {dtype} is not supported; choose one of {_dtype_choices()}")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        if config_dtype and config_dtype.lower() in DTYPES:
            return DTYPES[config_dtype.lower()]
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if key not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {_dtype_choices()}")
    return DTYPES[key]


def _dtype_choices() -> str:
    return "'auto', " + ", ".join(repr(k) for k in DTYPES) + " or a torch float dtype"


def load_model(
    name_or_path: str | os.PathLike[str],
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    quantization: str | None = None,
    shard: ModelShard | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build a Llama model with its weights; returns (model in eval mode, no grad; config).

    quantization="fp8" stores the linear layers' weights in FP8 (quantized as they load); a
    checkpoint stored in FP8 (compressed-tensors) loads as such whatever is asked. With a
    `shard`, the model is that tensor-parallel rank's part (the config returned is still
    the whole model's)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    device = torch.device(device)
    if is_gguf_path(os.fspath(name_or_path)):
        return _load_gguf(Path(os.fspath(name_or_path)).expanduser(), dtype, device, load_format, quantization,
                          shard)
    config, config_dtype, directory, stored = _read_config(os.fspath(name_or_path), load_format)
    quantization = stored or quantization
    if directory is None:
        load_format = "dummy"
    _check_meta(device, load_format)
    torch_dtype = resolve_dtype(dtype, device, config_dtype)

    def weights() -> Iterable[tuple[str, torch.Tensor]]:
        assert directory is not None
        return _iter_tensors(find_weight_files(directory), device, torch_dtype, shard)

    return _build(config, torch_dtype, device, load_format, quantization, shard, weights), config


def _load_gguf(path: Path, dtype: torch.dtype | str, device: torch.device, load_format: str,
               quantization: str | None, shard: ModelShard | None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """A GGUF file: config from its metadata, weights dequantized (or dummy ones); with
    quantization="fp8" the dequantized weights are re-quantized to FP8 as they load."""
    if load_format == "safetensors":
        raise ValueError(f"{str(path)!r} is a GGUF file, not safetensors: use load_format='auto'")
    _check_meta(device, load_format)
    from infer.models.gguf.config import config_from_gguf  # (the gguf library: for GGUF files only)
    from infer.models.gguf.reader import GGUFFile
    from infer.models.gguf.weights import check_tensors, iter_hf_tensors
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    check_tensors(gguf)  # before any memory is taken for the model
    torch_dtype = resolve_dtype(dtype, device)

    def weights() -> Iterable[tuple[str, torch.Tensor]]:
        show = path.stat().st_size > GGUF_PROGRESS_MIN_BYTES
        tensors = iter_hf_tensors(gguf, config, device, torch_dtype, progress=show)
        return tensors if shard is None else shard_tensors(tensors, shard)

    return _build(config, torch_dtype, device, load_format, quantization, shard, weights), config


def _check_meta(device: torch.device, load_format: str) -> None:
    if device.type == "meta" and load_format != "dummy":
        raise ValueError("device='meta' holds no data: use it only with load_format='dummy'")


def _build(config: ModelConfig, dtype: torch.dtype, device: torch.device, load_format: str, quantization: str | None,
           shard: ModelShard | None, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> LlamaForCausalLM:
    """The model (a shard's part of it) with dummy weights or the named tensors `weights()`
    yields, in eval mode without gradients."""
    if shard is not None:
        shard.check(config)
    model = build_empty_model(config, dtype, device, quantization, shard)
    if load_format == "dummy":
        _dummy_weights(model, config, quantization, shard)
    else:
        model.load_hf_weights(weights())
    model.eval().requires_grad_(False)
    return model


def read_model_config(name_or_path: str, load_format: str = "auto") -> ModelConfig:
    """The config of what `load_model` would load (a directory's config.json, a GGUF file's
    metadata, a dummy shape), without reading any weights."""
    if is_gguf_path(name_or_path):
        from infer.models.gguf.config import config_from_gguf
        from infer.models.gguf.reader import GGUFFile
        return config_from_gguf(GGUFFile.open(Path(name_or_path).expanduser()))
    return _read_config(name_or_path, load_format)[0]


def _read_config(name_or_path: str, load_format: str) -> tuple[ModelConfig, str | None, Path | None, str | None]:
    """(config, config's dtype name, directory or None for a named dummy shape, the
    quantization the checkpoint is stored in)."""
    shape = name_or_path.removeprefix(DUMMY_PREFIX)
    named_shape = load_format == "dummy" and shape in model_shapes and not Path(name_or_path).is_dir()
    if name_or_path.startswith(DUMMY_PREFIX) or named_shape:
        if load_format == "safetensors":
            raise ValueError(f"{name_or_path!r} names a dummy shape; it has no weight files, use "
                             "load_format='dummy' or 'auto'")
        if shape not in model_shapes:
            raise ValueError(f"unknown dummy shape {shape!r}; choose one of {sorted(model_shapes)}")
        return model_shapes[shape], None, None, None
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
    return config, raw.get("torch_dtype") or raw.get("dtype"), directory, checkpoint_quantization(raw)


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                      quantization: str | None = None, shard: ModelShard | None = None) -> LlamaForCausalLM:
    """Model (with a `shard`: that rank's part) with uninitialised parameters on `device`
    (no random-init cost); buffers valid."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, quantization) if shard is None else shard.build(config, quantization)
    model = model.to(dtype=dtype).to_empty(device=device)
    # to_empty replaces each Parameter separately: restore the tie and the rotary table
    model.tie_weights()
    for layer in model.linears().values():  # FP8 storage is not the model's dtype: made anew
        if isinstance(layer, Fp8Linear):
            layer.weight = torch.empty(layer.out_features, layer.in_features, dtype=FP8_DTYPE, device=device)
            layer.weight_scale = torch.ones(layer.out_features, dtype=torch.float32, device=device)
            layer.act_dtype = dtype
    model.rotary = Rotary(model.config).to(device)  # inv_freq stays float32, as in HF
    fp8 = {f"{name}.{leaf}" for name, m in model.linears().items() if isinstance(m, Fp8Linear)
           for leaf in ("weight", "weight_scale")}
    stale = [name for name, _ in model.named_buffers() if not name.startswith("rotary.") and name not in fp8]
    if stale:
        raise RuntimeError(f"build_empty_model does not know how to initialise buffers {stale}")
    return model


DUMMY_LOGIT_GAIN = 20.0


def _dummy_weights(model: LlamaForCausalLM, config: ModelConfig, quantization: str | None,
                   shard: ModelShard | None) -> None:
    """`init_dummy_weights`; a tensor-parallel rank keeps its part of the whole model's."""
    if shard is None:
        init_dummy_weights(model)
        return
    param = next(model.parameters())
    if param.device.type != "meta":
        model.load_hf_weights(shard_tensors(dummy_hf_tensors(config, quantization, param.dtype, param.device), shard))


def dummy_hf_tensors(config: ModelConfig, quantization: str | None, dtype: torch.dtype, device: torch.device,
                     seed: int = 0, std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `init_dummy_weights` gives a whole model of `config`, as Hugging Face
    named tensors, one at a time (the same draws in the same order): tensor-parallel ranks
    that each keep their part hold exactly the one-GPU dummy model."""
    with torch.device("meta"):
        meta = LlamaForCausalLM(config, quantization)
    norms = {id(m.weight) for m in meta.modules() if isinstance(m, RMSNorm)}
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
    for name, layer in meta.linears().items():
        if isinstance(layer, Fp8Linear):
            dense = torch.empty(layer.out_features, layer.in_features, device=device).normal_(0.0, std, generator=gen)
            yield from fused_to_hf(f"{name}.weight", dense, config)


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the model's shapes: normal(0, std) matrices, RMSNorm weights 1 except
    the final norm's (DUMMY_LOGIT_GAIN)."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in norms:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
        for layer in model.linears().values():  # FP8 weights are buffers: drawn, then quantized
            if isinstance(layer, Fp8Linear):
                dense = torch.empty(layer.out_features, layer.in_features, device=device)
                layer.load_rows(dense.normal_(0.0, std, generator=gen), None)
        # a final-norm gain of 20 scales the logits (std about 20 instead of 1): next-token
        # distributions are peaked, so greedy choices are not decided by bf16 rounding, yet
        # two different dummy models still disagree (a random draft accepts ~nothing)
        model.model.norm.weight.fill_(DUMMY_LOGIT_GAIN)


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


def _iter_tensors(files: list[Path], device: torch.device, dtype: torch.dtype,
                  shard: ModelShard | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor on device in dtype) from every file, one at a time, with progress;
    with a shard, only the shard's part of each tensor is read."""
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


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type
