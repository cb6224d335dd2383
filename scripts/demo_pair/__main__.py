"""The whole demo-pair pipeline in one command: train target and draft, then evaluate.

    PYTHONPATH=src:scripts python -m demo_pair --out src/infer/demo_models --log-dir runs/demo_pair
    PYTHONPATH=src:scripts python -m demo_pair --out /tmp/demo --preset tiny          # CPU smoke
    PYTHONPATH=src:scripts python -m demo_pair --out src/infer/demo_models --eagle-head --models none

Takes the options of `demo_pair.train`; writes OUT/target, OUT/draft (with README.md
model cards), LOG_DIR/train_log.json and LOG_DIR/eval_results.json. `--eagle-head` then
trains the target's EAGLE-3 head into OUT/eagle3 (`demo_pair.eagle_head`, on the CPU) and
compares it with the draft through the engine (`demo_pair.eagle_eval`,
LOG_DIR/eagle3_eval.json); `--models none` skips the pair (the head of an existing target).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from demo_pair import eagle_eval, eagle_head, evaluate, train
from demo_pair.presets import get_preset


def main(argv: list[str] | None = None) -> int:
    parser = train.build_parser()
    parser.prog = "python -m demo_pair"
    parser.add_argument("--max-new-tokens", type=int, default=evaluate.DEFAULT_MAX_NEW_TOKENS,
                        help="greedy completions in the cards")
    parser.add_argument("--eagle-head", action="store_true",
                        help="also train the target's EAGLE-3 head (CPU) into OUT/eagle3 and compare it with the draft")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    log_dir = Path(args.log_dir or out)
    if args.models != "none":
        train.run(args)
        eval_args = argparse.Namespace(
            target=str(out / "target"), draft=str(out / "draft"), out=str(log_dir / "eval_results.json"),
            device=args.device, k=evaluate.DEFAULT_K, max_new_tokens=args.max_new_tokens,
            max_files=get_preset(args.preset).max_files, no_cards=False)
        evaluate.run(eval_args)
    if args.eagle_head:
        eagle_head.run(eagle_head.build_parser().parse_args(
            ["--target", str(out / "target"), "--out", str(out / "eagle3"), "--preset", args.preset,
             "--seed", str(args.seed)]))
        if args.preset != "tiny":  # (the tiny models' 64-token context holds no evaluation prompt)
            eagle_eval.run(eagle_eval.build_parser().parse_args(
                ["--target", str(out / "target"), "--draft", str(out / "draft"), "--head", str(out / "eagle3"),
                 "--out", str(log_dir / "eagle3_eval.json")]))
    print(f"demo pipeline done in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
