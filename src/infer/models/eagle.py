"""EAGLE and EAGLE-3 draft heads in the public checkpoint layout, and their loader.

A head drafts from the target's own features with one decoder layer (EAGLE: Li et al.,
"EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", 2024; EAGLE-3:
"Scaling up Inference Acceleration of LLMs via Training-Time Test", 2025). At sequence
position i it takes the pair (f_i, t_{i+1}): a feature of position i and the embedding of
the token after it; its output x_i predicts t_{i+2} and is the feature of its next step.

- EAGLE (`method="eagle"`): f_i is the target's final hidden state (after its last norm).
  x = fc(cat(embed(t), f)) ([H, 2H], bias optional); the layer has no input norm:
  x = x + attn(x); x = x + mlp(post_attention_layernorm(x)). Logits: the target's lm_head(x).
  Tensors: fc.*, layers.0.* (no input_layernorm), embed_tokens.weight optional (else the
  target's embedding).
- EAGLE-3 (`method="eagle3"`): the target's inputs of three layers (default 2, L // 2,
  L - 3 of an L-layer target; `eagle_aux_hidden_state_layer_ids` in config.json, top level
  or in `eagle_config`, names others) go through fc ([H, 3 H_target], no bias) once: that
  is f. q/k/v read 2H inputs: cat(input_layernorm(embed(t)), hidden_norm(f)); the residual
  is f (hidden_norm(f) with `norm_before_residual`); then the MLP as above. Logits:
  lm_head(norm(x)) over `draft_vocab_size` tokens, draft id j being target id j + d2t[j]
  (t2d, the inverse set, is not needed). Tensors: fc.weight, midlayer.* (or layers.0.*),
  norm.weight, lm_head.weight, d2t, t2d, embed_tokens.weight optional.

`forward`, `logits` and `combine` take the decoder's `Kernels` bundle (models/kernels.py) as
the target's layers do: the MLP half is `kernels.mlp`, EAGLE-3's final norm + lm_head
`kernels.norm_linear`, the attention `kernels.attend` (the rotary with the cache write), the
projections `kernels.linear`; EAGLE-3's two input norms and their concatenation before q/k/v
stay single steps. EAGER by default; the engine's rounds pass its fused bundle.

`EagleHead.logits` returns target-vocabulary logits (-inf off the draft vocabulary), so the
proposer samples and reports q over target ids. `read_head_config` + `check_target` refuse
a head that does not fit the target from config.json alone, before any weight is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer.models.config import ModelConfig
from infer.models.kernels.bundle import EAGER, Kernels
from infer.models.layers.attention import AttentionView
from infer.models.layers.linear import make_linear
from infer.models.layers.mlp import MLP
from infer.models.layers.norms import RMSNorm
from infer.models.layers.rotary import Rotary, cos_sin
from infer.models.llama import Attention, LlamaForCausalLM, hf_to_fused
from infer.models.readers import find_weight_files, resolve_model_path

METHODS = ("eagle", "eagle3")


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    """A head's shape. layer: its decoder layer's (num_hidden_layers 1; vocab_size = the
    target's); draft_vocab_size: rows of an EAGLE-3 lm_head (the target's vocabulary for
    EAGLE); aux_layers: EAGLE-3's captured target layers, None for the default."""

    method: str
    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    source: str = "the head"  # where it came from, for error messages

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"EAGLE head method must be one of {METHODS}, got {self.method!r}")
        if self.layer.num_hidden_layers != 1:
            raise ValueError(f"{self.source}: infer runs EAGLE heads of one decoder layer, config.json has "
                             f"num_hidden_layers={self.layer.num_hidden_layers}")
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(f"{self.source}: draft_vocab_size {self.draft_vocab_size} must be in "
                             f"1..vocab_size ({self.layer.vocab_size})")
        if self.method == "eagle" and (self.draft_vocab_size != self.layer.vocab_size or self.aux_layers):
            raise ValueError(f"{self.source}: an EAGLE-1 head drafts over the target's vocabulary from its last "
                             "layer: draft_vocab_size and aux layer ids belong to EAGLE-3 (speculative_method='eagle3')")
        if self.aux_layers is not None and len(self.aux_layers) != 3:
            raise ValueError(f"{self.source}: EAGLE-3 reads 3 target layers, the config names {self.aux_layers}")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    def capture_points(self, target_layers: int) -> tuple[int, ...]:
        """The target's capture points (`HiddenCapture`): EAGLE its final output, EAGLE-3 three layer inputs."""
        if self.method == "eagle":
            return (target_layers,)
        return self.aux_layers if self.aux_layers is not None else (2, target_layers // 2, target_layers - 3)

    def check_target(self, target: ModelConfig) -> None:
        """Raise (naming the mismatch) unless the head fits this target."""
        problems = []
        if self.layer.hidden_size != target.hidden_size or self.target_hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.layer.hidden_size} (reads target features of "
                            f"{self.target_hidden_size}) vs the target's {target.hidden_size}")
        if self.layer.vocab_size != target.vocab_size:
            problems.append(f"vocabulary {self.layer.vocab_size} vs the target's {target.vocab_size}")
        if problems:
            raise ValueError(f"{self.source} does not fit the target: {'; '.join(problems)}. Use a head trained "
                             "for this target model")
        if self.method == "eagle3" and target.num_hidden_layers < 4 and self.aux_layers is None:
            raise ValueError(f"{self.source}: EAGLE-3's default layers (2, L//2, L-3) need a target of >= 4 layers, "
                             f"this one has {target.num_hidden_layers}: name them in config.json "
                             "(eagle_aux_hidden_state_layer_ids)")
        points = self.capture_points(target.num_hidden_layers)
        if any(not 0 <= p < target.num_hidden_layers for p in points) and self.method == "eagle3":
            raise ValueError(f"{self.source}: captured layers {points} do not exist in a target of "
                             f"{target.num_hidden_layers} layers (0..{target.num_hidden_layers - 1})")


def head_config_from_dict(raw: dict[str, Any], method: str, source: str = "the head") -> EagleHeadConfig:
    """An EagleHeadConfig from a head's config.json contents."""
    layer_raw = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    layer_raw.pop("attention_bias", None)  # (q/k/v biases are read from the tensors' presence)
    try:
        layer = ModelConfig.from_hf_dict(layer_raw)
    except KeyError as exc:
        raise ValueError(f"{source}: config.json lacks the required field {exc.args[0]!r}") from None
    eagle_config = raw.get("eagle_config") or {}
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    return EagleHeadConfig(method=method, layer=layer,
                           draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
                           target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
                           aux_layers=None if not aux else tuple(int(i) for i in aux),
                           norm_before_residual=bool(raw.get("norm_before_residual", False)), source=source)


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


class EagleHead(nn.Module):
    """The head's weights and its forward (module docstring). `config` is its layer's
    ModelConfig (what a KV pool is built from); `spec` the whole head's."""

    def __init__(self, spec: EagleHeadConfig, own_embeddings: bool, fc_bias: bool) -> None:
        super().__init__()
        self.spec, self.config = spec, spec.layer
        h, layer = spec.hidden_size, spec.layer
        fc_in = 2 * h if spec.method == "eagle" else 3 * spec.target_hidden_size
        self.fc = make_linear(fc_in, h, None, bias=fc_bias)
        self.self_attn = Attention(layer, 0)
        if spec.method == "eagle3":  # q/k/v read cat(normed embedding, normed feature)
            self.self_attn.qkv_proj = make_linear(2 * h, layer.q_size + 2 * layer.kv_size, None)
            self.input_layernorm = RMSNorm(h, layer.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, layer.rms_norm_eps)
            self.norm = RMSNorm(h, layer.rms_norm_eps)
            self.lm_head = make_linear(h, spec.draft_vocab_size, None)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        # whether draft ids differ from target ids, and the target id of each draft id [draft_vocab]:
        # fixed once the weights are in (`index_vocab`), so `logits` has no host sync (CUDA graphs)
        self.maps_vocab = spec.draft_vocab_size != layer.vocab_size
        self.target_ids: torch.Tensor | None = None
        self.mlp = MLP(layer)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.embed_tokens = nn.Embedding(layer.vocab_size, h) if own_embeddings else None
        self.rotary = Rotary(layer)
        self._target: tuple[LlamaForCausalLM, ...] = ()  # shared embedding / lm_head (not registered)

    def share(self, target: LlamaForCausalLM) -> None:
        """Use the target's embedding (unless the head has its own) and, for EAGLE, its lm_head."""
        self._target = (target,)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, H]."""
        table = self.embed_tokens if self.embed_tokens is not None else self._target[0].model.embed_tokens
        return table(ids.clamp(min=0))  # (NO_TOKEN, -1, of a faulted request reads row 0)

    def combine(self, captured: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """The target's captured states [M, D] -> the head's features [M, H] (EAGLE-3: fc)."""
        return captured if self.spec.method == "eagle" else kernels.linear(self.fc, captured, None)

    def forward(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                view: AttentionView, kernels: Kernels = EAGER) -> torch.Tensor:
        """ids, positions: [B, T]; features [B, T, H] (f_i of each token's position) -> the
        outputs x [B, T, H] (before any norm: the next step's features). `kernels` as the
        target's decoder layer takes them: EAGER's math, fused by a bundle where it can."""
        k = kernels
        emb = self.embed(ids).to(features.dtype)
        cos, sin = cos_sin(positions, self.rotary.inv_freq, features.dtype)
        eps = self.post_attention_layernorm.eps
        if self.spec.method == "eagle":
            x = k.linear(self.fc, torch.cat([emb, features], dim=-1), None)  # (no input norm)
            x = self.self_attn.attend_qkv(k.linear(self.self_attn.qkv_proj, x, None), x, cos, sin, view, k)
        else:  # (two norms of two halves before one projection: no fused entry serves it)
            e = k.rmsnorm(emb, self.input_layernorm.weight, eps)
            hn = k.rmsnorm(features, self.hidden_norm.weight, eps)
            residual = hn if self.spec.norm_before_residual else features
            qkv = k.linear(self.self_attn.qkv_proj, torch.cat([e, hn], dim=-1), None)
            x = self.self_attn.attend_qkv(qkv, residual, cos, sin, view, k)
        return k.mlp(self.mlp.gate_up_proj, self.mlp.down_proj, x, self.post_attention_layernorm.weight, eps)

    def logits(self, x: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Outputs [M, H] -> logits over the target's vocabulary [M, V] float32 (EAGLE-3:
        -inf at target ids outside the draft vocabulary)."""
        if self.spec.method == "eagle":
            return kernels.linear(self._target[0].lm_head, x, None).float()
        small = kernels.norm_linear(self.lm_head, x, self.norm.weight, self.norm.eps).float()
        if not self.maps_vocab:
            return small
        out = small.new_full((x.shape[0], self.config.vocab_size), float("-inf"))
        out[:, self.draft_to_target if self.target_ids is None else self.target_ids] = small
        return out

    def index_vocab(self) -> None:
        """Fix the draft -> target id map from the loaded d2t (EAGLE-3; call after loading)."""
        if self.spec.method == "eagle3":
            self.target_ids = self.draft_to_target.clone()
            self.maps_vocab = self.spec.draft_vocab_size != self.config.vocab_size or bool(self.d2t.any())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id."""
        return torch.arange(self.spec.draft_vocab_size, device=self.d2t.device) + self.d2t


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
    """The head in the target's dtype and device, sharing what it shares with the target.
    Refuses (before reading weights) a head that does not fit the target."""
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
