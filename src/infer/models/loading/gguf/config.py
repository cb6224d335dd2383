"""ModelConfig from a GGUF file's metadata (llama.cpp's `<architecture>.*` keys) and tensor table.

The vocabulary size is the embedding's row count; tied embeddings show as a missing
`output.weight`; Llama 3.1+ RoPE scaling is the `rope_freqs.weight` tensor (one divisor per
frequency: `ModelConfig.rope_freq_factors`).
"""

from __future__ import annotations

from gguf import TokenType

from infer.models.config import ModelConfig
from infer.models.loading.gguf.reader import GGUFFile
from infer.models.loading.gguf.weights import EMBEDDING, ROPE_FREQS, dequantize_tensor
from infer.models.special_tokens import LLAMA3_STOP_TOKENS

STOP_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id")
SUPPORTED_ROPE_SCALING = (None, "none")


# general.architecture -> ModelConfig.model_type (Mistral's files are written as "llama")
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The `ModelConfig` a GGUF file describes; clear errors for what infer cannot run."""
    if EMBEDDING not in gguf.tensors:
        raise ValueError(f"GGUF file {str(gguf.path)!r} has no {EMBEDDING!r} tensor: it holds no "
                         "model weights (a vocabulary-only file?)")
    hidden = _int(gguf, "embedding_length")
    heads = _int(gguf, "attention.head_count")
    head_dim = _int(gguf, "attention.key_length", hidden // heads)
    _check_rope(gguf, head_dim)
    return ModelConfig(
        vocab_size=gguf.tensors[EMBEDDING].shape[0],
        hidden_size=hidden,
        intermediate_size=_int(gguf, "feed_forward_length"),
        num_hidden_layers=_int(gguf, "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_int(gguf, "attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=_int(gguf, "context_length"),
        rms_norm_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf.arch_get("rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(gguf),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=stop_token_ids(gguf),
        model_type=MODEL_TYPES[gguf.architecture],
    )


def stop_token_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """Ids generation stops on: the metadata's eos/eot/eom ids and Llama 3's end tokens (as control
    tokens), as llama.cpp and Llama 3 instruct models' generation_config.json do."""
    ids = {gguf.get(key) for key in STOP_ID_KEYS} - {None}
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens", [])
    types: list[int] = gguf.get("tokenizer.ggml.token_type", [])
    for token_id, (token, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind == TokenType.CONTROL and token in LLAMA3_STOP_TOKENS:
            ids.add(token_id)
    return tuple(sorted(ids))


def _int(gguf: GGUFFile, suffix: str, default: int | None = None) -> int:
    value = gguf.arch_value(suffix) if default is None else gguf.arch_get(suffix, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GGUF file {str(gguf.path)!r}: {gguf.architecture}.{suffix} must be one "
                         f"integer, found {value!r}; per-layer values are not supported")
    return value


def _check_rope(gguf: GGUFFile, head_dim: int) -> None:
    rotary = _int(gguf, "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"GGUF file {str(gguf.path)!r} rotates {rotary} of {head_dim} head "
                         "dimensions; infer implements full-head RoPE only")
    value_length = _int(gguf, "attention.value_length", head_dim)
    if value_length != head_dim:
        raise ValueError(f"GGUF file {str(gguf.path)!r} has value heads of {value_length} and key "
                         f"heads of {head_dim} dimensions; infer needs them equal")
    scaling = gguf.arch_get("rope.scaling.type")
    if scaling not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"GGUF file {str(gguf.path)!r} uses RoPE scaling {scaling!r}; infer "
                         "implements Llama 3 frequency factors (rope_freqs.weight) and none")


def _rope_freq_factors(gguf: GGUFFile) -> tuple[float, ...] | None:
    tensor = gguf.tensors.get(ROPE_FREQS)
    if tensor is None:
        return None
    return tuple(float(v) for v in dequantize_tensor(tensor).reshape(-1).tolist())
