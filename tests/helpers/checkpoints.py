"""Tiny Llama checkpoints for tests, written by `transformers` itself.

`make_checkpoint(directory, variant)` builds a complete model directory in the exact
Hugging Face layout: config.json, model.safetensors (random weights from
`transformers.LlamaForCausalLM` under a fixed seed), generation_config.json, and a small
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with a chat template)
trained with the `tokenizers` library on a fixed text, so every piece of the engine can be
tested end to end without downloading anything.

Variants (all hidden 64, 2 layers, vocab = the tokenizer's size):
  "a": Llama 3 RoPE scaling (all three frequency bands exercised), tied embeddings,
       8 query heads over 2 KV heads (4:1 grouped-query attention).
  "b": untied embeddings, no RoPE scaling, 4 query heads over 2 KV heads.
  "c": head_dim 32 != hidden_size / num_heads (16), tied, 4 query heads over 2 KV heads.

Weights use `initializer_range` 0.2 rather than HF's 0.02 so that next-token distributions
are peaked: greedy parity then tests the model, not the order of floating-point near-ties.

`make_family_checkpoint(directory, family)` writes the same kind of directory for the other
families, each by its own transformers class (`FAMILIES`): "qwen2" (q/k/v biases, tied),
"qwen3" (per-head q/k RMSNorm, head_dim 32 != hidden / heads, untied), "mistral" (a sliding
window as long as the model's context). Biases and the q/k norm weights, which transformers
initialises to 0 and 1, are drawn at random so that a model that skipped them would differ.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
TARGET_VOCAB = 384

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog while the small cat watches from the garden wall.
Speculative decoding lets a small draft model propose several tokens that a large target model
verifies in a single forward pass; rejection sampling keeps the output distribution exactly the
same as sampling from the target alone. Once upon a time there was a little robot who loved to
read books about the stars, the sea and the mountains. Every morning it walked to the library,
said hello to the librarian and picked a new story. Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 and
100 appear in text too, as do punctuation marks: commas, periods, question marks? and quotes "".
def forward(self, input_ids, positions): return self.lm_head(self.model(input_ids, positions))
User: What is the capital of France? Assistant: The capital of France is Paris.
"""

VARIANTS: dict[str, dict[str, Any]] = {
    "a": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "b": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
    "c": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
}

BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer once per process; returns its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB, special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # like Llama 3's tokenizer.json: encoding with special tokens prepends BOS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    return tok.to_str()


def write_tokenizer(directory: str | Path) -> tuple[int, int, int]:
    """Write tokenizer.json + tokenizer_config.json; returns (vocab_size, bos_id, eos_id)."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json()
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = Tokenizer.from_str(text)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "model_max_length": BASE_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return tok.get_vocab_size(), tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)


def hf_config(variant: str = "a", vocab_size: int = TARGET_VOCAB, bos_id: int = 0, eos_id: int = 1,
              **overrides: Any) -> Any:
    """A `transformers.LlamaConfig` for one tiny variant (see the module docstring)."""
    from transformers import LlamaConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown checkpoint variant {variant!r}; choose one of {sorted(VARIANTS)}")
    kwargs = {**BASE_CONFIG, **VARIANTS[variant], "vocab_size": vocab_size,
              "bos_token_id": bos_id, "eos_token_id": eos_id, **overrides}
    return LlamaConfig(**kwargs)


def make_checkpoint(directory: str | Path, variant: str = "a", seed: int = 0, **overrides: Any) -> Path:
    """Write a complete tiny model directory (weights, config, tokenizer); returns its path.

    `overrides` are LlamaConfig fields (e.g. num_hidden_layers=3; vocab_size=400 gives a
    model vocabulary larger than the tokenizer's, as padded real vocabularies do).
    """
    from transformers import LlamaForCausalLM

    directory = Path(directory)
    vocab, bos_id, eos_id = write_tokenizer(directory)
    vocab = overrides.pop("vocab_size", vocab)
    config = hf_config(variant, vocab, bos_id, eos_id, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # family: (config class, model class, settings beyond BASE_CONFIG)
    "llama": ("LlamaConfig", "LlamaForCausalLM", VARIANTS["b"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "sliding_window": BASE_CONFIG["max_position_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
}


def family_model(family: str, vocab_size: int, bos_id: int = 0, eos_id: int = 1, seed: int = 0,
                 **overrides: Any) -> Any:
    """A random-weight transformers model of `family` (see FAMILIES), biases and q/k norm
    weights drawn too."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    config_cls, model_cls, settings = FAMILIES[family]
    kwargs = {**BASE_CONFIG, **settings, "vocab_size": vocab_size, "bos_token_id": bos_id,
              "eos_token_id": eos_id, **overrides}
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    return model


def make_family_checkpoint(directory: str | Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A complete tiny model directory of `family` (weights, config, tokenizer); returns its path."""
    directory = Path(directory)
    vocab, bos_id, eos_id = write_tokenizer(directory)
    vocab = overrides.pop("vocab_size", vocab)
    family_model(family, vocab, bos_id, eos_id, seed, **overrides).save_pretrained(directory, safe_serialization=True)
    return directory


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy a model directory (tests that corrupt a checkpoint work on a copy)."""
    return Path(shutil.copytree(src, dst))


def load_hf_model(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """The reference: transformers' own class for the directory's config.json
    (`AutoModelForCausalLM.from_pretrained`), eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def encode(directory: str | Path, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text` with the checkpoint's own tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=add_bos).ids


def mixed_prompts(directory: str | Path, seed: int) -> list[list[int]]:
    """Six prompts: four share a 12-token start (prefix cache blocks), one is long (chunked
    prefill), one repeats itself (n-gram matches); the short endings drawn with `seed`."""
    rng = random.Random(seed)
    words = "the cat sat on the mat and the dog sat on the log while a fox ran".split()
    shared = encode(directory, "Once upon a time there was a little robot")[:12]
    out = [shared + encode(directory, " ".join(rng.choice(words) for _ in range(rng.randint(2, 9))), add_bos=False)
           for _ in range(4)]
    out.append(encode(directory, " ".join(rng.choice(words) for _ in range(40))))
    out.append(encode(directory, "def forward(self, x): return x def forward(self, x): return"))
    return out


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: `transformers` generate (greedy, one prompt, no padding); new tokens only."""
    ids = torch.tensor([prompt], device=hf_model.device)
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1)
    new = out[0, len(prompt):].tolist()
    eos = _as_set(hf_model.generation_config.eos_token_id)
    return _cut_after_eos(new, eos)


def nocache_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: set[int] | frozenset[int] = frozenset()) -> list[list[int]]:
    """Our side: greedy decoding that recomputes the whole right-padded batch every step.

    Each row has its own length; `NoCacheView(chunk_lens)` masks the padding and each row's
    next-token logits are read at its last valid index. Rows stop after an eos token.
    """
    from infer.models.layers.attention import NoCacheView

    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        active = [i for i, toks in enumerate(new) if not (toks and toks[-1] in eos_ids)]
        if not active:
            break
        lens = torch.tensor([len(s) for s in seqs], device=device)  # [B]
        width = int(lens.max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)  # [B, T], right-padded
        for row, seq in enumerate(seqs):
            ids[row, :len(seq)] = torch.tensor(seq, device=device)
        positions = torch.arange(width, device=device).expand(len(seqs), width)  # [B, T]
        with torch.no_grad():
            logits = model(ids, positions, NoCacheView(lens), logits_indices=lens - 1)  # [B, V]
        next_ids = logits.argmax(-1).tolist()
        for row in active:
            seqs[row].append(next_ids[row])
            new[row].append(next_ids[row])
    return new


def _as_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple)) else {value}


def _cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[:i + 1]
    return tokens
