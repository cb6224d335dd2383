"""EAGLE / EAGLE-3 heads in the public checkpoint layout, with random weights, for a target directory.

`write_head(directory, target_dir, method)` writes config.json (LlamaForCausalLM-style, one
layer; EAGLE-3 adds draft_vocab_size and the captured layer ids) and model.safetensors
under the public tensor names: EAGLE `fc.weight` [H, 2H], `layers.0.*` without an input
norm; EAGLE-3 `fc.weight` [H, 3H], `midlayer.*` with 2H-wide q/k/v and `hidden_norm`,
`norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` and `t2d`. `reference_head` is the
format's forward in a few lines of plain torch, to check the engine's head against.
`counting_fused_kernels` is the fused bundle with EAGER's functions as its fallbacks (every
route on the CPU is the library one), counting the calls that reach them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from infer.models.kernels.bundle import Kernels, fused_kernels


def counting_fused_kernels() -> tuple[Kernels, list[str]]:
    """(the fused bundle whose elementwise steps are EAGER's own functions, the names of
    those steps as they are called)."""
    calls: list[str] = []

    def wrap(fn: Callable) -> Callable:
        def counted(*args: Any) -> Any:
            calls.append(fn.__name__)
            return fn(*args)
        return counted

    return fused_kernels(wrap), calls


def write_head(directory: Path, target_dir: Path, method: str, *, seed: int = 0, draft_vocab: int | None = None,
               aux_layers: list[int] | None = None, hidden_size: int | None = None,
               vocab_size: int | None = None, fc_bias: bool = False, own_embeddings: bool = False,
               std: float = 0.2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    h = hidden_size or target["hidden_size"]
    vocab = vocab_size or target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or target["hidden_size"] // heads
    inter = target["intermediate_size"]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if method == "eagle" else "LlamaForCausalLMEagle3"],
        "model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-5), "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": target.get("max_position_embeddings", 2048), "tie_word_embeddings": False,
    }
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(h, generator=gen)

    layer = "layers.0" if method == "eagle" else "midlayer"
    qkv_in = h if method == "eagle" else 2 * h
    t: dict[str, torch.Tensor] = {
        f"{layer}.self_attn.q_proj.weight": rand(heads * head_dim, qkv_in),
        f"{layer}.self_attn.k_proj.weight": rand(kv * head_dim, qkv_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv * head_dim, qkv_in),
        f"{layer}.self_attn.o_proj.weight": rand(h, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": rand(inter, h),
        f"{layer}.mlp.up_proj.weight": rand(inter, h),
        f"{layer}.mlp.down_proj.weight": rand(h, inter),
        f"{layer}.post_attention_layernorm.weight": norm(),
    }
    if method == "eagle":
        t["fc.weight"] = rand(h, 2 * h)
        if fc_bias:
            t["fc.bias"] = rand(h)
    else:
        dv = draft_vocab or vocab
        config["draft_vocab_size"] = dv
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
        t["fc.weight"] = rand(h, 3 * h)
        t[f"{layer}.input_layernorm.weight"] = norm()
        t[f"{layer}.hidden_norm.weight"] = norm()
        t["norm.weight"] = norm()
        t["lm_head.weight"] = rand(dv, h)
        ids = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values  # the draft vocabulary's target ids
        t["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if own_embeddings:
        t["embed_tokens.weight"] = rand(vocab, h)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in t.items()}, str(directory / "model.safetensors"))
    return directory


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] at positions 0..T-1, rotate-half convention, no scaling."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(x.shape[0]).float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def reference_head(directory: Path, method: str, embed: torch.Tensor, lm_head: torch.Tensor,
                   ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's forward over one sequence, from the files alone: ids [T], features [T, D]
    (EAGLE: the target's final hidden states; EAGLE-3: its 3 captured layers concatenated) ->
    (outputs [T, H], logits over the target vocabulary [T, V]); embed, lm_head: the target's."""
    from safetensors.torch import load_file
    cfg = json.loads((directory / "config.json").read_text())
    w = load_file(str(directory / "model.safetensors"))
    eps, heads, kv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    p = "layers.0" if method == "eagle" else "midlayer"
    e = embed[ids]
    if method == "eagle":
        x = torch.cat([e, features], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        attn_in, residual = x, x
    else:
        f = features @ w["fc.weight"].T
        attn_in = torch.cat([_rms(e, w[f"{p}.input_layernorm.weight"], eps), _rms(f, w[f"{p}.hidden_norm.weight"], eps)], -1)
        residual = f
    t = ids.shape[0]
    q = _rope((attn_in @ w[f"{p}.self_attn.q_proj.weight"].T).view(t, heads, hd), cfg["rope_theta"])
    k = _rope((attn_in @ w[f"{p}.self_attn.k_proj.weight"].T).view(t, kv, hd), cfg["rope_theta"])
    v = (attn_in @ w[f"{p}.self_attn.v_proj.weight"].T).view(t, kv, hd)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * hd)
    x = residual + att @ w[f"{p}.self_attn.o_proj.weight"].T
    h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(h @ w[f"{p}.mlp.gate_proj.weight"].T) * (h @ w[f"{p}.mlp.up_proj.weight"].T)
    x = x + mlp @ w[f"{p}.mlp.down_proj.weight"].T
    if method == "eagle":
        return x, x @ lm_head.T
    small = _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    logits = torch.full((t, embed.shape[0]), float("-inf"))
    logits[:, torch.arange(small.shape[1]) + w["d2t"]] = small
    return x, logits
