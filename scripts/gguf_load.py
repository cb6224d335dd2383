"""Load a GGUF file on the CPU as a new user would: the load's time and the process's peak
memory, then greedy completions of the README's prompts and their decode speed.

    PYTHONPATH=src python scripts/gguf_load.py MODEL.gguf --json out.json [--compare earlier.json]

One process per run: the load is timed after the imports (torch, infer and the gguf
library), once as `load_model` and once as `LLM(...)` (the engine: tokenizer, KV cache of
one 512-token sequence); the peak resident memory (VmHWM) is read after each stage. With
`--compare`, the greedy tokens are checked against another run's (e.g. another checkout's,
with its own PYTHONPATH) and the result says whether every completion is the same.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import infer.models.loading.gguf.weights  # noqa: F401  (the gguf library's import, outside the timed load)
import infer.tokenization.gguf  # noqa: F401  (and the tokenizer's)
from infer import LLM, SamplingParams
from infer.models.loading.loader import load_model

PLAIN = ["def fibonacci(n):", "def quicksort(xs):", "def is_prime(n):"]  # the README's prompts
CHAT = ["Hello", "Hi"]


def peak_mb() -> float:
    """The process's peak resident memory so far (Linux VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out: dict[str, object] = {"model": args.model, "threads": args.threads, "imported_peak_mb": peak_mb()}
    start = time.perf_counter()
    model, _ = load_model(args.model)
    out.update(load_model_s=time.perf_counter() - start, load_model_peak_mb=peak_mb())
    del model
    start = time.perf_counter()
    llm = LLM(args.model, device="cpu", threads=args.threads, max_batch_size=1, max_seq_len=512)
    out.update(llm_s=time.perf_counter() - start, llm_peak_mb=peak_mb())
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    tokens = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in PLAIN]
    tokens += [llm.chat([{"role": "user", "content": c}], greedy)[0].outputs[0].token_ids for c in CHAT]
    seconds = time.perf_counter() - start
    out.update(generate_peak_mb=peak_mb(), tokens=tokens, tokens_per_s=sum(map(len, tokens)) / seconds)
    if args.compare:
        out["same_tokens_as_compared"] = json.loads(args.compare.read_text())["tokens"] == tokens
    print(json.dumps({k: v for k, v in out.items() if k != "tokens"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
