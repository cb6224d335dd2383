"""Check shipped demo checkpoints: `python -m demo_pair.verify [TARGET_DIR DRAFT_DIR]`.

Checks what the package promises about `infer/demo_models/{target,draft}`: Hugging Face
layout with sharded bf16 safetensors (index + shards of at most 15 MiB, >= 2 for the
target), both directories together at most 40 MB, one shared tokenizer, and the same
logits through infer's loader and through transformers (when installed). Prints each
problem and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from demo_pair.saving import MAX_SHARD_BYTES
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
from infer.models.loading.loader import load_model

MAX_PAIR_BYTES = 40 * 10**6
REQUIRED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json")
PROBE = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def layout_problems(directory: Path, min_shards: int) -> list[str]:
    """Missing files, shard sizes and dtype of one checkpoint directory."""
    problems = [f"{directory}: missing {name}" for name in REQUIRED if not (directory / name).is_file()]
    if problems:
        return problems
    index = json.loads((directory / "model.safetensors.index.json").read_text(encoding="utf-8"))
    shards = sorted(set(index["weight_map"].values()))
    if len(shards) < min_shards:
        problems.append(f"{directory}: {len(shards)} shard(s), expected at least {min_shards}")
    for name in shards:
        size = (directory / name).stat().st_size
        if size > MAX_SHARD_BYTES:
            problems.append(f"{directory / name}: {size} bytes > {MAX_SHARD_BYTES}")
    dtype = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("torch_dtype")
    if dtype != "bfloat16":
        problems.append(f"{directory}/config.json: torch_dtype {dtype!r}, expected 'bfloat16'")
    return problems


def logits_problems(directory: Path) -> list[str]:
    """infer's loader vs transformers on a code snippet, both in float32."""
    from tokenizers import Tokenizer
    ids = torch.tensor([Tokenizer.from_file(str(directory / "tokenizer.json")).encode(PROBE).ids])
    ours, _ = load_model(str(directory), dtype=torch.float32)
    with torch.no_grad():
        a = ours(ids)  # [1, T, V]
    try:
        import transformers
    except ImportError:
        print(f"{directory}: transformers not installed, infer-only check")
        return []
    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        b = hf(ids).logits
    diff = float((a - b).abs().max())
    print(f"{directory}: max |logit difference| infer vs transformers = {diff:.2e}")
    return [] if diff <= 1e-3 else [f"{directory}: infer and transformers logits differ by {diff:.2e}"]


def verify(target: Path, draft: Path) -> list[str]:
    problems = layout_problems(target, 2) + layout_problems(draft, 1)
    if problems:
        return problems
    total = sum(p.stat().st_size for d in (target, draft) for p in d.iterdir() if p.is_file())
    print(f"pair on disk: {total / 1e6:.1f} MB")
    if total > MAX_PAIR_BYTES:
        problems.append(f"target + draft take {total} bytes > {MAX_PAIR_BYTES}")
    if (target / "tokenizer.json").read_bytes() != (draft / "tokenizer.json").read_bytes():
        problems.append("target and draft tokenizer.json differ: the pair must share one tokenizer")
    return problems + logits_problems(target) + logits_problems(draft)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m demo_pair.verify", description=__doc__.split("\n")[0])
    p.add_argument("target", nargs="?", default=str(DEMO_TARGET))
    p.add_argument("draft", nargs="?", default=str(DEMO_DRAFT))
    args = p.parse_args(argv)
    problems = verify(Path(args.target), Path(args.draft))
    for problem in problems:
        print("PROBLEM:", problem)
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
