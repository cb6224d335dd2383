"""Llama 3.x decoder (Llama-3.2-1B/3B, Llama-3.1-8B shapes): grouped-query attention,
RoPE (llama3 scaling or none), RMSNorm, SwiGLU, tied or untied embeddings.

`forward(input_ids, positions, view)` takes explicit positions per token and an
`AttentionView` that owns the KV cache, so padded batches, chunks after a cached prefix and
speculative verification are ordinary calls. q/k/v and gate/up projections are fused; the
mapping to and from Hugging Face tensor names lives in `hf_to_fused` / `fused_to_hf`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from infer.models.attention import AttentionView, NoCacheView
from infer.models.config import ModelConfig
from infer.models.kernels import EAGER, Kernels
from infer.models.layers import MLP, RMSNorm, Rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, view: AttentionView,
                kernels: Kernels = EAGER) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = kernels.rotary_qk(q.view(b, t, self.heads, self.head_dim),  # [B, T, Hq, D]
                                 k.view(b, t, self.kv_heads, self.head_dim), cos, sin)  # [B, T, Hkv, D]
        v = v.view(b, t, self.kv_heads, self.head_dim)
        out = view.attend(self.layer, q, k, v)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                view: AttentionView, kernels: Kernels = EAGER) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: returns (this layer's MLP output, residual before it); the
        caller adds them (fused into the next norm)."""
        eps = self.input_layernorm.eps
        if residual is None:
            residual, h = x, kernels.rmsnorm(x, self.input_layernorm.weight, eps)
        else:
            h, residual = kernels.add_rmsnorm(x, residual, self.input_layernorm.weight, eps)
        attn = self.self_attn(h, cos, sin, view, kernels)
        h, residual = kernels.add_rmsnorm(attn, residual, self.post_attention_layernorm.weight, eps)
        return self.mlp.down_proj(kernels.silu_mul(self.mlp.gate_up_proj(h))), residual


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.rotary = Rotary(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, view: AttentionView,
                      kernels: Kernels = EAGER) -> torch.Tensor:
        """input_ids, positions: [B, T] -> final normed hidden states [B, T, H]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, view, kernels)
        h, _ = kernels.add_rmsnorm(x, residual, self.model.norm.weight, self.model.norm.eps)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor | None = None,  # [B, T]; default 0..T-1
        view: AttentionView | None = None,  # default: no cache, causal
        logits_indices: torch.Tensor | None = None,  # [B]: only these tokens' logits
        kernels: Kernels = EAGER,  # compiled_kernels() on the fixed-shape GPU paths
    ) -> torch.Tensor:
        """Logits [B, T, V], or [B, V] for one token per row when logits_indices is given."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.hidden_states(input_ids, positions, view or NoCacheView(), kernels)
        if logits_indices is not None:
            h = h[torch.arange(h.shape[0], device=h.device), logits_indices]
        return self.lm_head(h)

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors in; raises if any is missing, extra or misshapen."""
        own = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        for hf_name, tensor in tensors:
            name, offset = hf_to_fused(hf_name, self.config)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some exports store the tied copy too
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # older exports store the (recomputed) rotary table
            param = own.get(name)
            if param is None:
                raise ValueError(f"checkpoint has unexpected tensor {hf_name!r} for this Llama config")
            rows = tensor.shape[0] if tensor.dim() else 0
            target = param.data[offset:offset + rows] if offset is not None else param.data
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, but config.json implies "
                    f"{tuple(target.shape)}: the weights do not match this config")
            with torch.no_grad():
                target.copy_(tensor)
            seen.add(hf_name)
        expected = [hf for name, p in self.named_parameters() for hf, _ in fused_to_hf(name, p, self.config)]
        missing = [hf for hf in expected if hf not in seen]
        if missing:
            raise ValueError(
                f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]!r}: "
                "the weight files are incomplete (re-download or re-save the model)")

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This model's weights under Hugging Face names (fused matrices split)."""
        for name, param in self.named_parameters():
            yield from fused_to_hf(name, param.detach(), self.config)


_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


def hf_to_fused(hf_name: str, config: ModelConfig) -> tuple[str, int | None]:
    """Map an HF tensor name to (our parameter name, row offset inside a fused matrix)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _QKV:
        offsets = {"q_proj": 0, "k_proj": config.q_size, "v_proj": config.q_size + config.kv_size}
        return ".".join(parts[:-2] + ["qkv_proj", "weight"]), offsets[parts[-2]]
    if len(parts) >= 2 and parts[-2] in _GATE_UP:
        offsets = {"gate_proj": 0, "up_proj": config.intermediate_size}
        return ".".join(parts[:-2] + ["gate_up_proj", "weight"]), offsets[parts[-2]]
    return hf_name, None


def fused_to_hf(name: str, tensor: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("qkv_proj.weight"):
        sizes = [config.q_size, config.kv_size, config.kv_size]
        for part, chunk in zip(_QKV, tensor.split(sizes), strict=True):
            yield f"{prefix}.{part}.weight", chunk
    elif name.endswith("gate_up_proj.weight"):
        for part, chunk in zip(_GATE_UP, tensor.split(config.intermediate_size), strict=True):
            yield f"{prefix}.{part}.weight", chunk
    else:
        yield name, tensor
