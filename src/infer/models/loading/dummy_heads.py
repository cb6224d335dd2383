"""Dummy draft heads: random weights in the shape heads for a named target would have.

For timing only. `<target>` is a shape key or a model directory: `dummy-eagle3:<target>` (an
EAGLE-3 head over `DUMMY_DRAFT_VOCAB` evenly spread target ids), `dummy-eagle:<target>` (EAGLE-1),
`dummy-medusa:<target>` (five Medusa heads of one block, as in the paper).
"""

from __future__ import annotations

import dataclasses

import torch

from infer.models.config import ModelConfig
from infer.models.eagle import EagleHead, EagleHeadConfig
from infer.models.layers.rotary import Rotary
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.loader import model_shapes, read_model_config
from infer.models.medusa import MedusaConfig, MedusaHead, build_head

DUMMY_HEAD_PREFIXES = {"dummy-eagle3:": "eagle3", "dummy-eagle:": "eagle"}
DUMMY_MEDUSA_PREFIX = "dummy-medusa:"
DUMMY_DRAFT_VOCAB = 32000
DUMMY_MEDUSA_HEADS, DUMMY_MEDUSA_LAYERS = 5, 1
DUMMY_STD = 0.02


def is_dummy_head(name: str) -> bool:
    return any(name.startswith(p) for p in DUMMY_HEAD_PREFIXES)


def dummy_head_config(name: str, method: str) -> EagleHeadConfig:
    """The head config a dummy head name implies (no weights)."""
    prefix = next((p for p in DUMMY_HEAD_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        raise ValueError(f"{name!r} is not a dummy head name: use one of {sorted(DUMMY_HEAD_PREFIXES)} + a shape")
    if DUMMY_HEAD_PREFIXES[prefix] != method:
        raise ValueError(f"{name!r} is a dummy {DUMMY_HEAD_PREFIXES[prefix]} head: set speculative_method="
                         f"{DUMMY_HEAD_PREFIXES[prefix]!r}, or name a dummy-{method}:<shape> head")
    return head_config_for(target_config(name, prefix), method, name)


def target_config(name: str, prefix: str) -> ModelConfig:
    """The config of the target named after `prefix`: a shape key (or "dummy:" + one) or a model directory."""
    target = name.removeprefix(prefix)
    if target.removeprefix("dummy:") in model_shapes:
        return model_shapes[target.removeprefix("dummy:")]
    try:
        return read_model_config(target)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{name!r}: the target after {prefix!r} must be a shape ({sorted(model_shapes)}) or a "
                         f"model directory: {exc}") from None


def head_config_for(target: ModelConfig, method: str, source: str = "a dummy head") -> EagleHeadConfig:
    """A one-layer head of the target's widths (EAGLE-3: DUMMY_DRAFT_VOCAB draft ids at most)."""
    layer = dataclasses.replace(target, num_hidden_layers=1, tie_word_embeddings=False)
    draft_vocab = min(DUMMY_DRAFT_VOCAB, target.vocab_size) if method == "eagle3" else target.vocab_size
    layers = target.num_hidden_layers  # (EAGLE-3's default points need 4 layers; tiny test models have fewer)
    aux = None if method == "eagle" or layers >= 4 else (0, layers // 2, layers - 1)
    return EagleHeadConfig(method=method, layer=layer, draft_vocab_size=draft_vocab,
                           target_hidden_size=target.hidden_size, aux_layers=aux, source=source)


@torch.no_grad()
def dummy_eagle_head(spec: EagleHeadConfig, target: LlamaForCausalLM, seed: int = 0) -> EagleHead:
    """A random head (normal(0, DUMMY_STD) matrices, norms 1) on the target's dtype and device."""
    spec.check_target(target.config)
    param = next(target.parameters())
    with torch.device("meta"):
        head = EagleHead(spec, own_embeddings=False, fc_bias=False)
    head = head.to(dtype=param.dtype).to_empty(device=param.device)
    head.rotary = Rotary(spec.layer).to(param.device)
    gen = torch.Generator(device=param.device).manual_seed(seed)
    for name, p in head.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.is_floating_point():
            p.normal_(0.0, DUMMY_STD, generator=gen)
    if spec.method == "eagle3":
        d, v = spec.draft_vocab_size, spec.layer.vocab_size
        ids = torch.arange(d, device=param.device) * (v // d)  # evenly spread target ids
        head.d2t.copy_(ids - torch.arange(d, device=param.device))
    head.index_vocab()
    head.share(target)
    head.eval().requires_grad_(False)
    return head


def is_dummy_medusa(name: str) -> bool:
    return name.startswith(DUMMY_MEDUSA_PREFIX)


def dummy_medusa_config(name: str) -> MedusaConfig:
    """The config `dummy-medusa:<shape or model directory>` implies: five one-block heads."""
    if not is_dummy_medusa(name):
        raise ValueError(f"{name!r} is not a dummy Medusa name: use {DUMMY_MEDUSA_PREFIX!r} + a shape or model "
                         "directory")
    config = target_config(name, DUMMY_MEDUSA_PREFIX)
    return MedusaConfig(DUMMY_MEDUSA_HEADS, DUMMY_MEDUSA_LAYERS, config.hidden_size, config.vocab_size,
                        f"dummy Medusa heads {name!r}")


@torch.no_grad()
def dummy_medusa_head(spec: MedusaConfig, dtype: torch.dtype, device: torch.device,
                      quantization: str | None = None, seed: int = 0) -> MedusaHead:
    """Random heads (matrices normal(0, DUMMY_STD), biases 0), loaded as a checkpoint (quantization applies)."""
    head = build_head(spec, dtype, device, quantization)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, layer in head.linears().items():
        w = torch.empty((layer.out_features, layer.in_features), dtype=dtype, device=device)
        layer.load_rows(w.normal_(0.0, DUMMY_STD, generator=gen), None, f"{name}.weight")
        if layer.bias is not None:
            layer.load_bias(torch.zeros_like(layer.bias), None, f"{name}.bias")
    return head.eval().requires_grad_(False)
