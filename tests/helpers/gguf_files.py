"""Tiny GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf(hf_dir, path, ...)` turns a tiny Hugging Face checkpoint (helpers.checkpoints)
into a GGUF file with the `gguf` library's `GGUFWriter`: `<architecture>.*` metadata
(`llama` for Llama and Mistral checkpoints, `qwen2`, `qwen3`), tensors renamed
(`token_embd.weight`, `blk.N.attn_q.weight`, `blk.N.attn_q.bias`, `blk.N.attn_q_norm.weight`,
..., `output_norm.weight`, `output.weight` unless tied), q/k rows permuted for llama.cpp's
rotary layout (the `llama` architecture only, as the converter does), Llama 3
RoPE scaling as the `rope_freqs.weight` factors, 1-D tensors in F32 and matrices in the
asked type (F32/F16/BF16/Q8_0/Q4_0/Q4_1 through `gguf.quants.quantize`; the K-quants,
which gguf-py cannot quantize, as random well-formed blocks), and the tokenizer as
`tokenizer.ggml.*` metadata: byte-level BPE ("gpt2") from the checkpoint's tokenizer.json,
or a SentencePiece vocabulary with scores ("llama", from a model `spm_vocab` trains).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import TokenType
from safetensors.torch import load_file

from helpers.checkpoints import CHAT_TEMPLATE, TRAINING_TEXT

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
# config.json's model_type -> general.architecture (llama.cpp writes Mistral files as llama)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass(frozen=True)
class SpmVocab:
    """A SentencePiece-style vocabulary: pieces with "▁" for spaces, scores, token types."""

    tokens: list[str]
    scores: list[float]
    types: list[int]


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    parts = hf.split(".")  # model.layers.N.<module>.weight (or .bias)
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotate-half halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3 RoPE scaling."""
    rope = config["rope_parameters"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def random_kquant(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random well-formed K-quant blocks ([rows, bytes per row] uint8): random quants and
    scales, with the fp16 super-block scales set so the weights are O(0.1)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (f16)
        blocks[:, 208:210] = rng.uniform(2e-5, 6e-5, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    else:  # d (f16), dmin (f16), scales[12], ...
        blocks[:, 0:2] = rng.uniform(1e-4, 3e-4, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
        blocks[:, 2:4] = rng.uniform(1e-4, 3e-4, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], shape[1] // block * size)


SPM_USER_TOKEN = "<|user|>"


def spm_vocab(size: int = 400) -> tuple[SpmVocab, Any]:
    """A Llama-2-style SentencePiece BPE model trained on the test text (identity
    normalization, dummy prefix, split digits, byte fallback, one user-defined symbol) and
    its vocabulary as llama.cpp's converter reads it: (SpmVocab, SentencePieceProcessor)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.splitlines() * 4), model_writer=model, model_type="bpe",
        vocab_size=size, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        character_coverage=1.0, user_defined_symbols=[SPM_USER_TOKEN], minloglevel=2)
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = (TokenType.UNKNOWN if sp.is_unknown(i) else TokenType.CONTROL if sp.is_control(i)
                else TokenType.UNUSED if sp.is_unused(i) else TokenType.BYTE if sp.is_byte(i)
                else TokenType.USER_DEFINED if tokens[-1] == SPM_USER_TOKEN else TokenType.NORMAL)
        types.append(int(kind))
    return SpmVocab(tokens, scores, types), sp


def write_gguf(hf_dir: str | Path, path: str | Path, weight_type: Q = Q.F32, *,
               overrides: dict[str, Q] | None = None, tokenizer: str = "gpt2", pre: str | None = "llama-bpe",
               spm: SpmVocab | None = None, add_bos: bool | None = True,
               chat_template: str | None = CHAT_TEMPLATE, architecture: str | None = None, seed: int = 0,
               edit: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Convert the checkpoint in `hf_dir` to the GGUF file `path`; returns `path`.

    `overrides` maps a short GGUF name ("ffn_down", "token_embd", ...) to its own type;
    `edit(writer)` runs last before writing (tests add or change metadata with it);
    `architecture` defaults to the checkpoint's (ARCHITECTURES).
    """
    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = architecture or ARCHITECTURES[config["model_type"]]
    weights = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), architecture)
    _write_hparams(writer, config)
    if tokenizer == "gpt2":
        _write_bpe_vocab(writer, hf_dir, config["vocab_size"], pre)
    else:
        assert spm is not None and len(spm.tokens) == config["vocab_size"]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(spm.tokens)
        writer.add_token_scores(spm.scores)
        writer.add_token_types(spm.types)
    special = (config["bos_token_id"], config["eos_token_id"]) if spm is None else (1, 2)  # <s>, </s>
    writer.add_bos_token_id(special[0])
    writer.add_eos_token_id(special[1])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)
    for name, tensor in weights.items():
        _add_tensor(writer, gguf_name(name), _converted(name, tensor, config, architecture == "llama"),
                    weight_type, overrides or {}, rng)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    if edit is not None:
        edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_name("tiny-llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])


def _write_bpe_vocab(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int, pre: str | None) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
        else:  # a model vocabulary padded past the tokenizer's
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    if pre is not None:  # files from before llama.cpp named pre-tokenizers have none
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)


def _converted(name: str, tensor: torch.Tensor, config: dict[str, Any], permuted: bool) -> np.ndarray:
    data = tensor.float().numpy()
    if not permuted:
        return data
    if name.endswith("q_proj.weight"):
        return permute(data, config["num_attention_heads"])
    if name.endswith("k_proj.weight"):
        return permute(data, config["num_key_value_heads"])
    return data


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, weight_type: Q,
                overrides: dict[str, Q], rng: np.random.Generator) -> None:
    short = name.removesuffix(".weight").split(".")[-1]
    qtype = Q.F32 if data.ndim == 1 else overrides.get(short, weight_type)
    if qtype == Q.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in K_QUANTS:
        writer.add_tensor(name, random_kquant(data.shape, qtype, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
