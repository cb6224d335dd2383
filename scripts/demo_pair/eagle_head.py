"""Train the demo target's EAGLE-3 head: `python -m demo_pair.eagle_head --target DIR --out DIR`.

Pipeline: the demo corpus encoded with the target's tokenizer (`demo_pair.train`'s corpus
step) -> the draft vocabulary (the most frequent training tokens) -> seeded windows: corpus
windows and the target's own greedy and T=1 continuations of corpus prompts
(`head_windows`) -> the frozen target's features over them (`demo_pair.eagle_data`;
`--cache DIR` keeps windows and features on disk for later runs) -> the head trained on
them (`demo_pair.eagle_train`, saved after every validation) -> saved in the public
EAGLE-3 layout that `infer.models.eagle` loads (config.json + model.safetensors: `fc`,
`midlayer.*`, `norm`, `lm_head` over the draft vocabulary, `d2t` / `t2d`; the target's
embedding is shared) with training_summary.json. Runs on the CPU (the `full` settings:
about 11 minutes generating, 6 extracting and 30 training on one core); `--init DIR` trains
a saved head further (the shipped head is four stages, the third with the `full` settings:
scripts/demo_pair/README.md). Seeded, so the same interpreter (corpus), seed and machine
give the same head.

    PYTHONPATH=src:scripts python -m demo_pair.eagle_head --target src/infer/demo_models/target --out /tmp/eagle3 \
        --cache /tmp/eagle3-cache
    PYTHONPATH=src:scripts python -m demo_pair.eagle_head --target src/infer/demo_models/target --out /tmp/eagle3-more \
        --init /tmp/eagle3 --cache /tmp/eagle3-cache --set lr=0.002 --head-set unroll=3
    PYTHONPATH=src:scripts python -m demo_pair.eagle_head --target /tmp/demo/target --out /tmp/demo/eagle3 --preset tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from demo_pair.bpe import load_tokenizer
from demo_pair.data import validation_chunks
from demo_pair.eagle_data import (HeadData, coverage, draft_vocabulary, extract_features, generated_windows,
                                   sample_windows, vocab_maps)
from demo_pair.eagle_train import HeadLog, HeadSettings, init_head, train_head
from demo_pair.presets import TrainSettings, get_preset, settings_with
from demo_pair.saving import SUMMARY_FILE, training_environment
from infer.models.eagle import EagleHead
from infer.models.llama import LlamaForCausalLM, fused_to_hf
from infer.models.loading.dummy_heads import head_config_for
from infer.models.loading.eagle_files import load_eagle_head
from infer.models.loading.loader import load_model

if TYPE_CHECKING:
    from demo_pair.train import Corpus

HEAD_PRESETS = {
    "full": HeadSettings(train=TrainSettings(epochs=2.5, batch_size=4, lr=3e-3, warmup_steps=10, weight_decay=0.01,
                                             eval_every=200, min_lr_ratio=0.05),
                         draft_vocab_size=4096, num_sequences=512, greedy_sequences=1024, sampled_sequences=1024,
                         aux_layers=(2, 4, 6), unroll=2),
    "tiny": HeadSettings(train=TrainSettings(epochs=1, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=4,
                                             max_steps=8), draft_vocab_size=256, seq_len=32, num_sequences=16,
                         greedy_sequences=4, greedy_prompt=8, valid_sequences=2, unroll=2),
}
DATA_FIELDS = ("seq_len", "num_sequences", "greedy_sequences", "sampled_sequences", "greedy_prompt",
               "valid_sequences")  # the HeadSettings the teacher's features depend on
TOP_LEVEL = ("fc.weight", "norm.weight", "lm_head.weight")  # the rest is the decoder layer, `midlayer.*`
SAVE_DTYPE = torch.bfloat16


def build_head(target: LlamaForCausalLM, draft_ids: torch.Tensor, seed: int,
               aux_layers: tuple[int, ...] | None = None) -> EagleHead:
    """A freshly initialised EAGLE-3 head of the target's widths over the draft vocabulary
    `draft_ids` [D] (sorted target ids), sharing the target's embedding. Its final norm and
    lm_head start as the target's (rows of the draft vocabulary): the head then only has to
    learn to predict the target's last hidden state. Its captured layers (`aux_layers`, else
    EAGLE-3's defaults) are named in the spec, so config.json lists them."""
    spec = head_config_for(target.config, "eagle3", "the demo EAGLE-3 head")
    spec = dataclasses.replace(spec, draft_vocab_size=draft_ids.numel(),
                               aux_layers=aux_layers or spec.capture_points(target.config.num_hidden_layers))
    spec.check_target(target.config)
    head = EagleHead(spec, own_embeddings=False, fc_bias=False)
    init_head(head, seed)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(vocab_maps(draft_ids, target.config.vocab_size)[0])
    head.share(target)
    return head


def continue_from(head: EagleHead, directory: str, target: LlamaForCausalLM) -> None:
    """Start `head` from a saved head's weights (to train it further); same draft vocabulary."""
    saved = load_eagle_head(directory, "eagle3", target)
    if not torch.equal(saved.d2t, head.d2t):
        raise ValueError(f"the head in {directory} has another draft vocabulary: train it with the same "
                         "draft_vocab_size and corpus, or leave out --init")
    head.load_state_dict(saved.state_dict())


def public_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under the public EAGLE-3 names (bf16), d2t and t2d."""
    out: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        for hf_name, tensor in fused_to_hf(name, param.detach(), head.config):
            key = hf_name if hf_name in TOP_LEVEL else f"midlayer.{hf_name}"
            out[key] = tensor.to(SAVE_DTYPE).contiguous()
    d2t = head.d2t.detach().clone()
    out["d2t"] = d2t
    out["t2d"] = vocab_maps(torch.arange(d2t.numel()) + d2t, head.config.vocab_size)[1]
    return out


def head_config_json(head: EagleHead) -> dict[str, Any]:
    c, spec = head.config, head.spec
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layers or ())},
    }


def save_head(head: EagleHead, directory: Path, summary: dict[str, Any]) -> Path:
    """config.json, model.safetensors and training_summary.json, readable by everyone."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(head_config_json(head), indent=2) + "\n", encoding="utf-8")
    save_file(public_tensors(head), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)
    return directory


def run(args: argparse.Namespace) -> dict[str, Any]:
    from demo_pair.train import prepare_corpus  # (the corpus step of the pair's training)
    settings = HEAD_PRESETS[args.preset]
    settings = dataclasses.replace(settings, train=settings_with(settings.train, args.set or []),
                                   **dict(_head_override(o) for o in args.head_set or []))
    torch.manual_seed(args.seed)
    target, _ = load_model(args.target, dtype=torch.float32, device="cpu")
    target.eval().requires_grad_(False)
    tok = load_tokenizer(args.target)
    _, corpus = prepare_corpus(get_preset(args.preset), tok, target.config.vocab_size)
    draft_ids = draft_vocabulary(corpus.train, target.config.vocab_size, settings.draft_vocab_size)
    head = build_head(target, draft_ids, args.seed, settings.aux_layers)
    if args.init:
        continue_from(head, args.init, target)
    aux_layers = head.spec.capture_points(target.config.num_hidden_layers)
    cpu_start = time.process_time()
    data, valid, seconds = head_data(args.target, target, corpus, settings, aux_layers, args.seed,
                                     Path(args.cache) if args.cache else None)
    print(f"[eagle3] {len(data)} + {sum(len(v) for v in valid.values())} windows ({seconds}); draft vocabulary "
          f"{draft_ids.numel()} covers {coverage(corpus.train, draft_ids, target.config.vocab_size):.3f} "
          "of the training tokens", flush=True)

    def summary_of(log: HeadLog) -> dict[str, Any]:
        out = {
            "role": "eagle3", "target": str(args.target), "seed": args.seed, "init": args.init,
            "settings": dataclasses.asdict(settings),
            "num_parameters": sum(p.numel() for p in head.parameters()), "aux_layers": list(aux_layers),
            "draft_vocab_coverage": {"train": coverage(corpus.train, draft_ids, target.config.vocab_size),
                                     "valid": coverage(corpus.valid, draft_ids, target.config.vocab_size)},
            "generate_seconds": seconds["generate"], "feature_seconds": seconds["features"],
            "cpu_seconds": time.process_time() - cpu_start, "corpus": corpus.stats,
            "environment": training_environment(torch.device("cpu")) | {"threads": str(torch.get_num_threads())},
            "log": log.to_dict()}
        if args.init and (Path(args.init) / SUMMARY_FILE).is_file():  # the run it continues
            out["init_summary"] = json.loads((Path(args.init) / SUMMARY_FILE).read_text(encoding="utf-8"))
        return out

    def checkpoint(log: HeadLog) -> None:  # the head so far, in case the run is cut short
        save_head(head, Path(args.out), summary_of(log) | {"checkpoint_at_step": log.valid[-1]["step"]})

    log = train_head(head, target, data, valid, draft_ids, settings, args.seed, checkpoint=checkpoint)
    head.index_vocab()
    summary = summary_of(log)
    save_head(head, Path(args.out), summary)
    print(f"[eagle3] saved to {args.out} ({log.seconds + sum(seconds.values()):.0f} s)", flush=True)
    return summary


def head_windows(target_dir: str, corpus: Corpus, s: HeadSettings, seed: int) -> dict[str, torch.Tensor]:
    """The token windows [n, S] the head trains ("train": corpus windows, then the target's
    greedy and T=1 continuations of corpus prompts) and validates on ("valid": validation-split
    windows; "valid_greedy" / "valid_sampled": the target's continuations of their first tokens)."""
    windows = [sample_windows(corpus.train, s.seq_len, s.num_sequences, seed)]  # [n, S]
    valid = torch.stack([c[:s.seq_len] for c in validation_chunks(corpus.valid, s.seq_len)
                         if c.numel() > s.seq_len][:s.valid_sequences])
    out = {"valid": valid}
    new_tokens = s.seq_len - s.greedy_prompt
    prompts = sample_windows(corpus.train, s.greedy_prompt, s.greedy_sequences + s.sampled_sequences, seed + 1)
    for name, part, temperature in (("greedy", prompts[:s.greedy_sequences], 0.0),
                                    ("sampled", prompts[s.greedy_sequences:], 1.0)):
        if part.shape[0]:
            windows.append(generated_windows(target_dir, part, new_tokens, temperature, seed))
            out[f"valid_{name}"] = generated_windows(target_dir, valid[:, :s.greedy_prompt], new_tokens,
                                                     temperature, seed + part.shape[0])
    return {"train": torch.cat(windows)} | out


def head_data(target_dir: str, target: LlamaForCausalLM, corpus: Corpus, s: HeadSettings,
              aux_layers: tuple[int, ...], seed: int,
              cache: Path | None) -> tuple[HeadData, dict[str, HeadData], dict[str, float]]:
    """The teacher's features of `head_windows` (validation sets named by their log prefix:
    "", "greedy_", "sampled_"), with the seconds spent generating and extracting. `cache`: a
    directory keeping the windows and the features, keyed by everything they depend on, read
    back by a later run (the windows alone serve a run with other aux layers)."""
    key = [str(Path(target_dir).resolve()), corpus.stats, seed, [getattr(s, f) for f in DATA_FIELDS]]
    windows_path = _cache_file(cache, "windows", key)
    features_path = _cache_file(cache, "features", [*key, list(aux_layers)])
    if features_path is not None and features_path.is_file():
        print(f"[eagle3] features read from {features_path}", flush=True)
        saved = torch.load(features_path, weights_only=True)
        return (HeadData(**saved["train"]), {k: HeadData(**v) for k, v in saved["valid"].items()},
                {"generate": 0.0, "features": 0.0})
    start = time.perf_counter()
    if windows_path is not None and windows_path.is_file():
        windows = torch.load(windows_path, weights_only=True)
    else:
        windows = head_windows(target_dir, corpus, s, seed)
        if windows_path is not None:
            windows_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(windows, windows_path)
    seconds = {"generate": time.perf_counter() - start}
    data = extract_features(target, windows.pop("train"), aux_layers, log_every=16)
    valid = {name.removeprefix("valid").lstrip("_") + ("_" if name != "valid" else ""):
             extract_features(target, w, aux_layers) for name, w in windows.items()}
    seconds["features"] = time.perf_counter() - start - seconds["generate"]
    if features_path is not None:
        torch.save({"train": dataclasses.asdict(data), "valid": {k: dataclasses.asdict(v) for k, v in valid.items()}},
                   features_path)
    return data, valid, seconds


def _cache_file(cache: Path | None, kind: str, key: list[Any]) -> Path | None:
    return None if cache is None else cache / f"{kind}-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.pt"


def _head_override(item: str) -> tuple[str, Any]:
    name, sep, value = item.partition("=")
    name = name.strip().replace("-", "_")
    fields = {f.name: f.type for f in dataclasses.fields(HeadSettings) if f.name != "train"}
    if not sep or name not in fields:
        raise ValueError(f"head setting {item!r} must be NAME=VALUE with NAME one of {sorted(fields)}")
    kind = str(fields[name])
    if kind.startswith("tuple"):  # aux_layers=2,4,6
        return name, tuple(int(v) for v in value.split(","))
    return name, (float if kind == "float" else int)(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo_pair.eagle_head", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="the demo target's directory (the teacher)")
    p.add_argument("--out", required=True, help="the head's directory")
    p.add_argument("--preset", choices=sorted(HEAD_PRESETS), default="full", help="'tiny' for a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", help="a saved head to start from (trains it further), e.g. the shipped one")
    p.add_argument("--cache", help="a directory to keep the teacher's features in, read back by later runs "
                   "of the same data settings (e.g. /tmp/eagle3-features)")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", help="a training setting, e.g. lr=0.002")
    p.add_argument("--head-set", action="append", metavar="NAME=VALUE",
                   help="a head setting, e.g. unroll=2 or draft_vocab_size=4096")
    return p


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
