"""Draft models whose tokenizer is not the target's (token-level intersection tests).

- `foreign_draft(dir)`: a one-layer random model whose byte-level BPE vocabulary is trained
  on another corpus (`OTHER_TEXT`) with another size: it shares the byte alphabet and part
  of the merges with checkpoint "a"'s tokenizer, and its ids differ throughout.
- `permuted_draft(target, dir)`: the target itself with its vocabulary's ids shuffled (the
  embedding and lm_head rows moved with them; the specials <s> and </s> keep ids 0 and 1):
  every token is shared and the draft's distribution is the target's, so acceptance near 1
  shows the mapping right in both directions.
- `tiny_pair(factory)`: the TV test's pair on four-token vocabularies that share "a" and "b"
  (at other ids); the target's "ab" reaches the draft as "a" "b", its "d" as nothing, and the
  draft's "x" and "y" are not the target's.
- `narrow_draft(dir)`: a vocabulary trained on Cyrillic text without the byte alphabet,
  sharing a few single bytes with checkpoint "a"'s: refused.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from helpers.checkpoints import BOS_TOKEN, EOS_TOKEN, TRAINING_TEXT, copy_checkpoint, family_model, make_checkpoint

OTHER_TEXT = """\
A little robot walked along the sea wall at night and counted the stars: one, two, three.
The draft proposes, the target verifies; tokens that both vocabularies hold travel between them.
Mountains and rivers, books and libraries, foxes and dogs all appear in the stories it read.
print(sum(x * x for x in range(100)))  # the numbers 0 to 99, squared and summed
"""
NARROW_WORDS = ("привет мир как дела хорошо спасибо маленький робот читал книги о звёздах и море каждое утро он "
                "ходил в библиотеку здоровался с библиотекарем выбирал новую историю горы реки лисы собаки кошка "
                "сидела на стене сада черновик предлагает цель проверяет числа слова строки").split()


def bpe_json(corpus: str, vocab_size: int, alphabet: bool = True) -> str:
    """A byte-level BPE tokenizer.json trained on `corpus` (<s> and </s> at ids 0 and 1); without
    `alphabet` it holds only the bytes the corpus uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [])
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    return tok.to_str()


def with_tokenizer(directory: Path, text: str, seed: int, **overrides: Any) -> Path:
    """A tiny model directory (helpers.checkpoints, variant "b") whose tokenizer.json is `text`."""
    size = len(json.loads(text)["model"]["vocab"])
    directory = make_checkpoint(directory, variant="b", seed=seed, vocab_size=size, **overrides)
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    return directory


def foreign_draft(directory: Path, seed: int = 7) -> Path:
    return with_tokenizer(directory, bpe_json(OTHER_TEXT + TRAINING_TEXT[:200], 330), seed, num_hidden_layers=1)


def narrow_draft(directory: Path) -> Path:
    rng = random.Random(0)
    text = " ".join(rng.choice(NARROW_WORDS) for _ in range(800))
    return with_tokenizer(directory, bpe_json(text, 400, alphabet=False), seed=5, num_hidden_layers=1)


def permuted_draft(target: Path, directory: Path, seed: int = 0) -> Path:
    """The target with its vocabulary's ids shuffled (module docstring)."""
    from safetensors.torch import load_file, save_file

    draft = copy_checkpoint(target, directory)
    data = json.loads((draft / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    moved = list(range(2, len(vocab)))
    random.Random(seed).shuffle(moved)
    new_id = [0, 1, *moved]  # old id -> new id
    data["model"]["vocab"] = {token: new_id[i] for token, i in vocab.items()}
    (draft / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    weights = load_file(str(draft / "model.safetensors"))
    order = sorted(range(len(new_id)), key=new_id.__getitem__)  # new id -> old id
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name] = weights[name][order].contiguous()
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return draft


TARGET_TOKENS = ("a", "b", "ab", "d")
DRAFT_TOKENS = ("b", "x", "a", "y")


def tiny_vocab_model(directory: Path, tokens: tuple[str, ...], merges: list[tuple[str, str]], seed: int,
                     layers: int) -> Path:
    """A random Llama (variant "b") over exactly `tokens`, with their byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    family_model("llama", len(tokens), 0, 1, seed, num_hidden_layers=layers).save_pretrained(directory)
    return directory


def tiny_pair(factory: Any) -> tuple[Path, Path]:
    """(target, draft) of the TV test (module docstring). `factory`: pytest's tmp_path_factory."""
    return (tiny_vocab_model(factory.mktemp("t"), TARGET_TOKENS, [("a", "b")], seed=1, layers=2),
            tiny_vocab_model(factory.mktemp("d"), DRAFT_TOKENS, [], seed=2, layers=1))
