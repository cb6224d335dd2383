"""EAGLE and EAGLE-3 draft heads: one decoder layer drafting from the target's own features.

EAGLE (Li et al., 2024) and EAGLE-3 (Li et al., 2025): at position i the head reads (f_i, t_{i+1}),
a target feature and the next token's embedding; its output x_i predicts t_{i+2} and is its next
step's feature. Formats: docs/architecture.md (EAGLE heads); loading: models/loading/eagle_files.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer.models.config import ModelConfig
from infer.models.kernels.bundle import EAGER, CompiledKernels, Kernels
from infer.models.layers.attention import AttentionView
from infer.models.layers.linear import make_linear
from infer.models.layers.mlp import MLP
from infer.models.layers.norms import RMSNorm
from infer.models.layers.rotary import Rotary, cos_sin
from infer.models.llama import Attention, LlamaForCausalLM
from infer.models.vocab_rows import spread_logits

METHODS = ("eagle", "eagle3")


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    """A head's shape. layer: its one decoder layer (vocab_size: the target's); draft_vocab_size:
    rows of an EAGLE-3 lm_head; aux_layers: EAGLE-3's captured target layers (None: default)."""

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


class EagleHead(nn.Module):
    """The head's weights and forward. `config`: its layer's ModelConfig (for a KV pool); `spec`: the head's."""

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
        # draft -> target id map [draft_vocab], fixed by `index_vocab` so `logits` has no host sync
        self.maps_vocab = spec.draft_vocab_size != layer.vocab_size
        self.target_ids: torch.Tensor | None = None
        self.mlp = MLP(layer)
        self.post_attention_layernorm = RMSNorm(h, layer.rms_norm_eps)
        self.embed_tokens = nn.Embedding(layer.vocab_size, h) if own_embeddings else None
        self.rotary = Rotary(layer)
        self._target: tuple[LlamaForCausalLM, ...] = ()  # shared embedding / lm_head (not registered)
        self.compiled = CompiledKernels()  # its fused bundle, compiled at first use (its rounds on a GPU)

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
        """ids, positions: [B, T]; features f [B, T, H] -> outputs x [B, T, H] (unnormed: the next
        step's features)."""
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
        """Outputs [M, H] -> float32 logits over target ids [M, V] (-inf outside a draft vocabulary)."""
        if self.spec.method == "eagle":
            return kernels.linear(self._target[0].lm_head, x, None).float()
        small = kernels.norm_linear(self.lm_head, x, self.norm.weight, self.norm.eps).float()
        if not self.maps_vocab:
            return small
        ids = self.draft_to_target if self.target_ids is None else self.target_ids
        return spread_logits(small, ids, self.config.vocab_size)

    def index_vocab(self) -> None:
        """Fix the draft -> target id map from the loaded d2t (EAGLE-3; call after loading)."""
        if self.spec.method == "eagle3":
            self.target_ids = self.draft_to_target.clone()
            self.maps_vocab = self.spec.draft_vocab_size != self.config.vocab_size or bool(self.d2t.any())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target id of each draft id."""
        return torch.arange(self.spec.draft_vocab_size, device=self.d2t.device) + self.d2t
