"""The whole demo-pair pipeline in one command: train target and draft, then evaluate.

    PYTHONPATH=src python -m infer.demo --out src/infer/demo_models --log-dir runs/demo_pair
    PYTHONPATH=src python -m infer.demo --out /tmp/demo --preset tiny          # CPU smoke

Takes the options of `infer.demo.train`; writes OUT/target, OUT/draft (with README.md
model cards), LOG_DIR/train_log.json and LOG_DIR/eval_results.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from infer.demo import evaluate, train
from infer.demo.presets import get_preset


def main(argv: list[str] | None = None) -> int:
    parser = train.build_parser()
    parser.prog = "python -m infer.demo"
    parser.add_argument("--max-new-tokens", type=int, default=evaluate.DEFAULT_MAX_NEW_TOKENS,
                        help="greedy completions in the cards")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    train.run(args)
    out = Path(args.out)
    log_dir = Path(args.log_dir or out)
    eval_args = argparse.Namespace(
        target=str(out / "target"), draft=str(out / "draft"), out=str(log_dir / "eval_results.json"),
        device=args.device, k=evaluate.DEFAULT_K, max_new_tokens=args.max_new_tokens,
        max_files=get_preset(args.preset).max_files, no_cards=False)
    evaluate.run(eval_args)
    print(f"demo pipeline done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
