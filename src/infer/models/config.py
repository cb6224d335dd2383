"""ModelConfig: the parts of a Hugging Face `config.json` the forward pass needs, per family.

Families differ in a few switches (`FAMILIES`): Llama 3.x and Mistral share Llama's layout, Qwen2 adds q/k/v biases,
Qwen3 RMSNorms each q and k head before the rotary. Validated on construction; `from_hf_dict` rejects what is not
implemented. Sliding-window attention is not implemented: `check_context` refuses contexts longer than the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



@dataclass(frozen=True, slots=True)
class Family:
    """What sets a decoder family apart from Llama's."""

    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures entry
    gguf_architecture: str  # general.architecture of its llama.cpp files
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary (Qwen3)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "llama"),
    Family("mistral", "MistralForCausalLM", "llama"),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
)}
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0:
            raise ValueError("rope_scaling: factor and low_freq_factor must be > 0")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must be > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # [head_dim // 2] divisors of the rotary inverse frequencies (GGUF's rope_freqs tensor)
    rope_freq_factors: tuple[float, ...] | None = None
    model_type: str = "llama"  # a key of FAMILIES
    sliding_window: int | None = None  # attention window in tokens (Mistral); None: full

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; choose one of {sorted(FAMILIES)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "config.json: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError("config.json: head_dim must be even for rotary embeddings")
        if self.rope_freq_factors is not None:
            if self.rope_scaling is not None:
                raise ValueError("rope_freq_factors and rope_scaling both rescale the rotary "
                                 "frequencies; give one of them")
            if len(self.rope_freq_factors) != self.head_dim // 2 or min(self.rope_freq_factors) <= 0:
                raise ValueError(f"rope_freq_factors must hold head_dim // 2 = {self.head_dim // 2} "
                                 f"positive values, got {len(self.rope_freq_factors)}")

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def check_context(self, max_seq_len: int) -> None:
        """Raise when a sequence of `max_seq_len` tokens would need the sliding window."""
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise ValueError(
                f"this {self.model_type} model attends over a sliding window of {self.sliding_window} tokens, "
                f"which infer does not implement; sequences up to max_seq_len={max_seq_len} would attend "
                f"further and give different results: set max_seq_len <= {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count as Hugging Face reports it (tied embeddings counted once)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        family = FAMILIES.get(model_type or "")
        if family is None or (archs and family.architecture not in archs):
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: infer implements "
                f"{', '.join(f'{f.architecture} (model_type {f.model_type!r})' for f in FAMILIES.values())}")
        _check_layout(raw, family)
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        # transformers >= 5 writes rope settings as one `rope_parameters` dict
        rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=_parse_rope_scaling(rope),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=family.model_type,
            sliding_window=_sliding_window(raw, family),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json contents in the Hugging Face Llama layout (rope_theta / rope_scaling keys)."""
        if self.rope_freq_factors is not None:
            raise ValueError("this config's RoPE scaling is a list of frequency factors (from a GGUF "
                             "file), which config.json cannot express")
        raw: dict[str, Any] = {
            "architectures": [self.family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            raw.update(attention_bias=False, mlp_bias=False)
        elif self.model_type == "mistral":
            raw["sliding_window"] = self.sliding_window
        else:  # qwen2, qwen3
            raw.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window,
                       max_window_layers=0)
        if self.rope_scaling is not None:
            raw["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        return raw


def _check_layout(raw: dict[str, Any], family: Family) -> None:
    """Options of a family's config.json that infer does not implement: a clear error each."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported; infer implements SwiGLU (silu)")
    if raw.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported (no family infer implements has MLP biases)")
    if raw.get("attention_bias") and not family.qkv_bias:
        raise ValueError(f"config.json: attention_bias=true is not supported for model_type {family.model_type!r}")


def _sliding_window(raw: dict[str, Any], family: Family) -> int | None:
    """The attention window a config asks for (Qwen's only with use_sliding_window)."""
    if family.model_type == "llama":
        return None
    if family.model_type != "mistral" and not raw.get("use_sliding_window"):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: infer implements 'llama3' and none")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
