"""Loading what an engine runs on: target model, optional draft model or heads, tokenizer.

A model may be a directory, a hub id or a GGUF file; without `model` the bundled demo models
are used. `check_before_loading` checks what files can tell before any weight is read;
`load_models` returns `LoadedModels` (with heads, the target gets a `HiddenCapture`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from infer.engine.config import EngineConfig
from infer.engine.parts import EAGLE_METHODS, MEDUSA, LoadConfig, SpeculativeConfig
from infer.engine.pairing import VocabularyFacts, check_pair
from infer.models.capture import HiddenCapture
from infer.models.eagle import EagleHead, EagleHeadConfig
from infer.models.layers.shard import ModelShard
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.dummy_heads import dummy_eagle_head, dummy_head_config, is_dummy_head
from infer.models.loading.dummy_heads import dummy_medusa_config, dummy_medusa_head, is_dummy_medusa
from infer.models.loading.eagle_files import load_eagle_head, read_head_config
from infer.models.loading.gguf.path import is_gguf_path
from infer.models.loading.loader import load_model, read_model_config
from infer.models.loading.medusa_files import load_medusa_head, read_medusa_config
from infer.models.loading.readers import resolve_model_path
from infer.models.medusa import MedusaConfig, MedusaHead
from infer.speculative.draft_vocab import DraftVocab, draft_rows, load_table
from infer.speculative.vocab_map import VocabMap
from infer.tokenization import Tokenizer

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_models"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"
DEMO_EAGLE3 = DEMO_DIR / "eagle3"  # the demo target's trained EAGLE-3 head
DEMO_ROLES = ("target", "draft", "eagle3")  # the shipped pair and the target's EAGLE-3 head
# how the shipped demo models are made, from a checkout (scripts/demo_pair/README.md)
DEMO_TRAIN_COMMAND = "PYTHONPATH=src:scripts python -m demo_pair"


def demo_model_path(role: str = "target") -> Path:
    """Directory of the shipped demo `role` ("target", "draft" or "eagle3": the target's
    EAGLE-3 head) in Hugging Face layout."""
    if role not in DEMO_ROLES:
        raise ValueError(f"role must be one of {DEMO_ROLES}, got {role!r}")
    path = DEMO_DIR / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the demo {role} is not installed at {path}: train it from a checkout with "
            f"`{DEMO_TRAIN_COMMAND} --out src/infer/demo_models --eagle-head` (see scripts/demo_pair/README.md)")
    return path


@dataclass
class LoadedModels:
    target: LlamaForCausalLM
    draft: LlamaForCausalLM | None
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    head: EagleHead | None = None  # speculative_method "eagle" / "eagle3"
    vocab_map: VocabMap | None = None  # a draft with another vocabulary: the tokens it shares with the target
    medusa: MedusaHead | None = None  # speculative_method "medusa"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is available: use device='cpu'")
    return torch.device(device)


def model_sources(config: EngineConfig) -> tuple[str, str | None, str | None, str | None]:
    """(target, draft model, EAGLE head, Medusa heads) `config` loads, the demo's where no model
    was given (None for the methods not used)."""
    method = config.speculative_method if config.use_speculative_decoding else None
    target = config.model if config.model is not None else str(DEMO_TARGET)
    demo = config.model is None and config.draft_model is None
    draft_model = head = medusa = None
    if method == "draft_model":
        draft_model = str(DEMO_DRAFT) if demo else config.draft_model
    elif method in EAGLE_METHODS:
        head = str(DEMO_EAGLE3) if demo and method == "eagle3" else config.draft_model
    elif method == MEDUSA:
        medusa = config.draft_model
    return target, draft_model, head, medusa


def load_part(config: EngineConfig, device: torch.device | None = None) -> LoadConfig:
    """`config`'s loading part, its sources, device (`config.device`'s unless given) and dtype decided."""
    device = device if device is not None else resolve_device(config.device)
    target, draft_model, head, medusa = model_sources(config)
    return LoadConfig(target, config.tokenizer or target, device, model_dtype(config.dtype, device),
                      config.load_format, config.quantization, config.draft_quantization, draft_model, head, medusa,
                      config.spec_draft_vocab, config.seed, config.threads)


def load_models_for(config: EngineConfig, device: torch.device | None = None) -> LoadedModels:
    """`load_models` of `config`'s parts, outside an engine (benchmarks, tests)."""
    return load_models(load_part(config, device), config.speculative_part(), max_seq_len=config.max_seq_len)


def load_tokenizer(name_or_path: str) -> Tokenizer | None:
    """The tokenizer in a model directory or GGUF file; None for file-less dummy shapes."""
    if name_or_path.startswith("dummy:"):
        return None
    if is_gguf_path(name_or_path):
        return Tokenizer.from_pretrained(name_or_path)
    return Tokenizer.from_pretrained(resolve_model_path(name_or_path))


Checked = tuple[Tokenizer | None, VocabMap | None]  # the target's tokenizer, a draft's vocabulary map


def check_before_loading(load: LoadConfig) -> Checked:
    """(the target's tokenizer, the draft's `VocabMap` when its vocabulary differs), the draft
    checked against the target from config and tokenizer files only."""
    tokenizer = load_tokenizer(load.tokenizer)
    if load.draft_model is None:
        return tokenizer, None
    target = _vocabulary_facts(load, load.model, tokenizer)
    try:
        draft_tokenizer = load_tokenizer(load.draft_model)
    except ValueError as exc:
        raise ValueError(f"the draft model's tokenizer, which is compared with the target's: {exc}") from exc
    return tokenizer, check_pair(target, _vocabulary_facts(load, load.draft_model, draft_tokenizer))


def _vocabulary_facts(load: LoadConfig, path: str, tokenizer: Tokenizer | None) -> VocabularyFacts:
    logits = read_model_config(path, load.load_format).vocab_size
    if tokenizer is None:
        return VocabularyFacts(path, logits, None)
    return VocabularyFacts(path, logits, tokenizer.vocabulary(), tokenizer.token_keys())


def model_dtype(dtype: str, device: torch.device) -> str:
    # bf16 matmuls are slow and inexact on CPUs: "auto" means float32 there
    return "float32" if dtype == "auto" and device.type == "cpu" else dtype


def load_target(load: LoadConfig, shard: ModelShard | None = None, *, max_seq_len: int | None) -> LlamaForCausalLM:
    """The target model (with a tensor-parallel `shard`: that rank's part); `max_seq_len`:
    the longest sequence it will run, refused past a sliding window (None: unchecked)."""
    return load_model(load.model, dtype=load.dtype, device=load.device, load_format=load.load_format,
                      quantization=load.quantization, shard=shard, max_seq_len=max_seq_len)[0]


def load_draft(load: LoadConfig, target: LlamaForCausalLM, shard: ModelShard | None = None,
               vocab_map: VocabMap | None = None, *, max_seq_len: int | None) -> LlamaForCausalLM:
    """The draft model in the target's dtype (with a `shard`: that rank's part), its vocabulary
    reduced to `draft_vocab`'s table (through `vocab_map` for another vocabulary)."""
    assert load.draft_model is not None
    draft = load_model(load.draft_model, dtype=next(target.parameters()).dtype, device=load.device,
                       load_format=load.load_format, quantization=load.draft_quantization, shard=shard,
                       max_seq_len=max_seq_len)[0]
    table = draft_vocab_table(load)
    if table is not None:
        draft.keep_vocab(torch.tensor(draft_rows(table, vocab_map)))
    return draft


def load_models(load: LoadConfig, speculative: SpeculativeConfig | None = None,
                target_shard: ModelShard | None = None, draft_shard: ModelShard | None = None, *,
                max_seq_len: int | None, checked: Checked | None = None) -> LoadedModels:
    """Target, draft or heads (what `load` names) and tokenizer; `speculative`: the method and K
    the heads are checked against; shards under tensor parallelism (a draft without one loads
    whole); `max_seq_len` as `load_target`'s; `checked`: `check_before_loading`'s result."""
    tokenizer, vocab_map = check_before_loading(load) if checked is None else checked
    draft_vocab_table(load)  # (refused here, before any weight is read)
    method = speculative.method if speculative is not None else None
    if load.head is not None:  # refused from config files, before any weight is read
        assert method is not None
        head_config(load.head, method).check_target(read_model_config(load.model, load.load_format))
    if load.medusa is not None:  # (likewise)
        assert speculative is not None
        check_medusa(load, speculative.length)
    target = load_target(load, target_shard, max_seq_len=max_seq_len)
    draft = None if load.draft_model is None else load_draft(load, target, draft_shard, vocab_map,
                                                             max_seq_len=max_seq_len)
    head = None if load.head is None or method is None else load_head(load.head, method, target)
    medusa = None if load.medusa is None else load_medusa(load, target)
    eos = tokenizer.eos_token_ids if tokenizer is not None else target.config.eos_token_ids
    return LoadedModels(target, draft, tokenizer, tuple(eos), head, vocab_map, medusa)


def draft_vocab_table(load: LoadConfig) -> DraftVocab | None:
    """The reduced draft vocabulary's table, checked against the target's vocabulary size."""
    if load.draft_vocab is None:
        return None
    table = load_table(load.draft_vocab)
    table.check_target(read_model_config(load.model, load.load_format).vocab_size,
                       f"spec_draft_vocab {load.draft_vocab!r}")
    return table


def head_config(path: str, method: str) -> EagleHeadConfig:
    """The head's config: a directory's config.json, or a dummy head's (`models/loading/dummy_heads.py`)."""
    return dummy_head_config(path, method) if is_dummy_head(path) else read_head_config(path, method)


def load_head(path: str, method: str, target: LlamaForCausalLM) -> EagleHead:
    """The EAGLE head (target's dtype and device), and the target's capture of what it reads."""
    if is_dummy_head(path):
        head = dummy_eagle_head(dummy_head_config(path, method), target)
    else:
        head = load_eagle_head(path, method, target)
    target.capture = HiddenCapture(head.spec.capture_points(target.config.num_hidden_layers))
    return head


def medusa_config(path: str) -> MedusaConfig:
    """Medusa heads' config: a directory's config.json, or dummy heads' (`dummy-medusa:<shape>`)."""
    return dummy_medusa_config(path) if is_dummy_medusa(path) else read_medusa_config(path)


def check_medusa(load: LoadConfig, depth: int) -> None:
    """Refuse heads that do not fit the target or a round of `depth`, from config files alone."""
    assert load.medusa is not None
    spec = medusa_config(load.medusa)
    spec.check_target(read_model_config(load.model, load.load_format))
    spec.check_depth(depth)


def load_medusa(load: LoadConfig, target: LlamaForCausalLM) -> MedusaHead:
    """The Medusa heads (target's dtype and device), and the target's capture of its final normed output."""
    assert load.medusa is not None
    norm = target.model.norm.weight  # (in the model's dtype whatever its linears are stored as)
    if is_dummy_medusa(load.medusa):
        spec = dummy_medusa_config(load.medusa)
        spec.check_target(target.config)
        head = dummy_medusa_head(spec, norm.dtype, norm.device, load.draft_quantization)
    else:
        head = load_medusa_head(load.medusa, target.config, norm.dtype, norm.device, load.draft_quantization)
    target.capture = HiddenCapture((target.config.num_hidden_layers,))
    return head
