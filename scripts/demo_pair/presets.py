"""Shapes and training settings of the demo draft/target pair, full size and tiny (CPU smoke).

Why these shapes. The pair stands in for Llama-3.2-1B (draft) / Llama-3.2-3B (target) in
speculative-decoding benchmarks. At batch 1 on a GPU, models this small are bound by
kernel launches, not arithmetic, so a forward pass costs about the same per decoder layer
whatever its width: the draft/target cost ratio c of the paper (Definition 3.7) is about
the ratio of layer counts. 1B/3B has 16/28 layers = 0.571; the demo pair has 4/7 = 0.571.
The width then sets quality: target ~14.2 M parameters (hidden 384, 7 layers), draft
1.84 M (hidden 128, intermediate 384, 4 layers), tied embeddings, bf16 on disk: ~32 MB for
both. Heads are 64 wide (as in Llama 3.2 1B) with grouped-query attention, RoPE theta
10000 (contexts of 1024 need no larger base), context 1024.

Why the draft is this narrow. The corpus is small (~1.9 M tokens), so the target's
knowledge is bounded by the data rather than by its size, and distillation hands the
draft all of it: a 3.0 M draft (hidden 192) distilled from the target below ends within
0.04 nats of the target's validation loss (alpha 0.79). A real pair's draft is clearly the
weaker model, so the draft keeps hidden 128: 0.13 nats above the target, alpha 0.745,
greedy agreement 0.72 (scripts/demo_pair/README.md has the sweep).

Training. Data, not compute, is the limit, and strong decoupled weight decay is what
generalises. Target validation losses of the sweep (Python 3.12 stdlib, H200): weight
decay 0.1, dropout 0.1, 8 epochs (the first recipe) 3.33; 12 epochs with dropout 0.1 and
weight decay 1.0 / 2.0: 2.95 / 2.90; dropout 0.2, weight decay 2.0: 2.85. More dropout
hurt (10 epochs, weight decay 0.5: dropout 0.3 / 0.4 gave 3.01 / 3.13). The target gets
12 epochs, weight decay 2.0, residual dropout 0.2, and keeps the weights of its best
validation check (early stopping). The draft is distilled from the target (KL to its soft
labels) for 16 epochs. Batches of 16 x 1024 tokens; on one H100/H200 each model trains in
under a minute. No torch.compile: the runs are short, so compiling would not pay back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from demo_pair.bpe import BOS_ID, DEFAULT_VOCAB_SIZE, EOS_ID
from infer.models.config import ModelConfig

ROPE_THETA = 10000.0
PRESETS = ("full", "tiny")


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings of one model. Steps = ceil(epochs * sequences / batch_size)."""

    epochs: float
    batch_size: int
    lr: float
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    dropout: float = 0.0  # residual dropout, training only
    distill_weight: float = 0.0  # 0: hard labels only; 1: KL to the teacher only
    eval_every: int = 50
    max_steps: int | None = None  # cap (smoke tests)
    # "best": keep the weights of the validation check with the lowest loss (KL to the
    # teacher when distilling) -- early stopping, in case the model overfits the small
    # corpus; "last": the weights after the final step
    select: str = "best"

    def __post_init__(self) -> None:
        if self.epochs <= 0 or self.batch_size <= 0 or self.lr <= 0:
            raise ValueError("TrainSettings: epochs, batch_size and lr must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainSettings: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TrainSettings: dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"TrainSettings: distill_weight must be in [0, 1], got {self.distill_weight}")
        if self.warmup_steps < 0 or self.eval_every <= 0:
            raise ValueError("TrainSettings: warmup_steps must be >= 0 and eval_every > 0")
        if self.select not in ("best", "last"):
            raise ValueError(f"TrainSettings: select must be 'best' or 'last', got {self.select!r}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"TrainSettings: max_steps must be > 0, got {self.max_steps}")

    def total_steps(self, num_sequences: int) -> int:
        if num_sequences <= 0:
            raise ValueError("the training stream is shorter than one sequence: use more files "
                             "or a shorter --seq-len")
        steps = -(-int(self.epochs * num_sequences) // self.batch_size)
        steps = max(steps, 1)
        return min(steps, self.max_steps) if self.max_steps else steps


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    seq_len: int
    target: ModelConfig
    draft: ModelConfig
    target_train: TrainSettings
    draft_train: TrainSettings
    max_files: int | None = None  # corpus subset (tiny preset)


def _llama(vocab: int, seq_len: int, hidden: int, inter: int, layers: int, heads: int,
           kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=ROPE_THETA,
        rope_scaling=None, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))


def full_preset() -> Preset:
    vocab, seq = DEFAULT_VOCAB_SIZE, 1024
    return Preset(
        vocab_size=vocab, seq_len=seq,
        target=_llama(vocab, seq, hidden=384, inter=1024, layers=7, heads=6, kv_heads=2, head_dim=64),
        draft=_llama(vocab, seq, hidden=128, inter=384, layers=4, heads=2, kv_heads=1, head_dim=64),
        target_train=TrainSettings(epochs=12, batch_size=16, lr=2e-3, weight_decay=2.0, dropout=0.2),
        draft_train=TrainSettings(epochs=16, batch_size=16, lr=3e-3, distill_weight=1.0),
    )


def tiny_preset() -> Preset:
    vocab, seq = 384, 64
    return Preset(
        vocab_size=vocab, seq_len=seq,
        target=_llama(vocab, seq, hidden=48, inter=96, layers=2, heads=2, kv_heads=1, head_dim=24),
        draft=_llama(vocab, seq, hidden=32, inter=64, layers=1, heads=2, kv_heads=1, head_dim=16),
        target_train=TrainSettings(epochs=1, batch_size=8, lr=1e-2, warmup_steps=3, eval_every=10,
                                   max_steps=30),
        draft_train=TrainSettings(epochs=1, batch_size=8, lr=1e-2, warmup_steps=3, eval_every=10,
                                  max_steps=30, distill_weight=1.0),
        max_files=40,
    )


def settings_with(s: TrainSettings, overrides: list[str]) -> TrainSettings:
    """`s` with fields replaced from "name=value" strings (e.g. "dropout=0.3"); the value is
    parsed as the field's declared type (int, float or str; "none" clears max_steps)."""
    changes: dict[str, object] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in TrainSettings.__dataclass_fields__ or name == "betas":
            fields = sorted(f for f in TrainSettings.__dataclass_fields__ if f != "betas")
            raise ValueError(f"setting override {item!r} must be NAME=VALUE with NAME one of {fields}")
        kind = str(TrainSettings.__dataclass_fields__[name].type)  # "float", "int | None", ...
        parse = {"int": int, "str": str}.get(kind.split(" | ")[0], float)
        try:
            none = kind.endswith("| None") and value.strip().lower() == "none"
            changes[name] = None if none else parse(value.strip())
        except ValueError:
            raise ValueError(f"setting override {item!r}: {value!r} is not a valid {kind}") from None
    return replace(s, **changes)  # __post_init__ validates the result


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")


def config_with(config: ModelConfig, overrides: list[str]) -> ModelConfig:
    """`config` with shape fields replaced from "name=value" strings (integers), e.g.
    "hidden_size=128"; ModelConfig validates the result."""
    changes: dict[str, int] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in SHAPE_FIELDS:
            raise ValueError(f"shape override {item!r} must be NAME=VALUE with NAME one of {SHAPE_FIELDS}")
        try:
            changes[name] = int(value)
        except ValueError:
            raise ValueError(f"shape override {item!r}: {value!r} is not an integer") from None
    return replace(config, **changes)


def get_preset(name: str) -> Preset:
    if name == "full":
        return full_preset()
    if name == "tiny":
        return tiny_preset()
    raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")


def with_seq_len(preset: Preset, seq_len: int) -> Preset:
    """The preset trained on sequences of `seq_len` (also the models' context length)."""
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    return replace(preset, seq_len=seq_len,
                   target=replace(preset.target, max_position_embeddings=seq_len),
                   draft=replace(preset.draft, max_position_embeddings=seq_len))
