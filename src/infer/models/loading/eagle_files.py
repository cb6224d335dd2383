"""EAGLE and EAGLE-3 head checkpoints in the public layout: reading and loading.

A head directory (or hub id) holds config.json and safetensors (or pytorch_model.bin) weights;
`load_eagle_head` maps the checkpoint's names (`midlayer.*` or `layers.0.*`) onto `EagleHead`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from infer.models.eagle import EagleHead, EagleHeadConfig, head_config_from_dict
from infer.models.layers.rotary import Rotary
from infer.models.llama import LlamaForCausalLM, hf_to_fused
from infer.models.loading.readers import find_weight_files, resolve_model_path


def read_head_config(name_or_path: str, method: str) -> EagleHeadConfig:
    """The head's config from its directory's config.json (no weight is read)."""
    directory = resolve_model_path(name_or_path)
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} has no config.json: an EAGLE head directory holds config.json "
                                "and its weights (model.safetensors or pytorch_model.bin)")
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return head_config_from_dict(raw, method, f"EAGLE head {str(directory)!r}")


def head_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of a head's weight files: safetensors, else pytorch_model.bin."""
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins and not any(directory.glob("*.safetensors")):
        for path in bins:
            yield from torch.load(path, map_location="cpu", weights_only=True).items()
        return
    from safetensors import safe_open
    for path in find_weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _our_name(name: str, method: str) -> str | None:
    """A checkpoint tensor's parameter name in `EagleHead` (None: not used)."""
    name = name.removeprefix("model.")
    for layer_prefix in ("midlayer.", "layers.0."):
        name = name.removeprefix(layer_prefix)
    if name == "t2d" or (method == "eagle" and name in ("input_layernorm.weight", "lm_head.weight")):
        return None  # the inverse map; EAGLE's layer 0 has no input norm and it reads the target's lm_head
    return name


def load_eagle_head(name_or_path: str, method: str, target: LlamaForCausalLM) -> EagleHead:
    """The head in the target's dtype and device, sharing what it shares with the target
    (`EagleHead.share`); refuses a head that does not fit the target before reading weights."""
    spec = read_head_config(name_or_path, method)
    spec.check_target(target.config)
    raw: dict[str, torch.Tensor] = {}
    for name, tensor in head_tensors(resolve_model_path(name_or_path)):
        ours = _our_name(name, method)
        if ours is not None:
            raw[ours] = tensor
    param = next(target.parameters())
    with torch.device("meta"):
        head = EagleHead(spec, own_embeddings="embed_tokens.weight" in raw, fc_bias="fc.bias" in raw)
    head = head.to(dtype=param.dtype).to_empty(device=param.device)
    head.rotary = Rotary(spec.layer).to(param.device)
    _load(head, raw)
    head.index_vocab()
    head.share(target)
    head.eval().requires_grad_(False)
    return head


def _load(head: EagleHead, tensors: dict[str, torch.Tensor]) -> None:
    own = dict(head.named_parameters())
    buffers = dict(head.named_buffers())
    linears = {n: m for n, m in head.named_modules() if hasattr(m, "load_rows")}
    seen: set[str] = set()
    for name, tensor in tensors.items():
        fused, offset = hf_to_fused(name, head.config)
        module, _, leaf = fused.rpartition(".")
        layer = linears.get(module)
        if layer is not None and leaf in ("weight", "bias"):
            if leaf == "weight":
                layer.load_rows(tensor.to(layer.weight.dtype), offset, name)
            else:
                layer.load_bias(tensor.to(layer.bias.dtype), offset, name)
            seen.add(fused if offset is None else f"{fused}#{offset}")
            continue
        target = own.get(fused, buffers.get(fused))
        if target is None:
            raise ValueError(f"{head.spec.source}: unexpected tensor {name!r} for an {head.spec.method} head: "
                             f"check speculative_method ('eagle' or 'eagle3')")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{head.spec.source}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json "
                             f"implies {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(fused)
    _check_complete(head, seen)


def _check_complete(head: EagleHead, seen: set[str]) -> None:
    parts = {"self_attn.qkv_proj.weight": 3, "mlp.gate_up_proj.weight": 2}
    missing = []
    for name, _ in head.named_parameters():
        if name.endswith(".bias") and name.startswith("self_attn.qkv_proj"):
            continue
        got = sum(1 for s in seen if s == name or s.startswith(f"{name}#"))
        if got < parts.get(name, 1):
            missing.append(name)
    if head.spec.method == "eagle3" and head.spec.draft_vocab_size != head.config.vocab_size and "d2t" not in seen:
        missing.append("d2t")
    if missing:
        raise ValueError(f"{head.spec.source} is missing tensor(s) {missing}: the head's weight files are incomplete")
    if head.spec.method == "eagle3":
        ids = head.draft_to_target
        if int(ids.min()) < 0 or int(ids.max()) >= head.config.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"{head.spec.source}: d2t maps draft ids outside the target's vocabulary or twice")
