"""The demo EAGLE-3 head beside the demo draft model, through the engine, on the CPU.

    PYTHONPATH=src:scripts python -m demo_pair.eagle_eval --out runs/eagle3_eval.json

For each of the demo pair's evaluation prompts (`demo_pair.completions.PROMPTS`) and each
temperature (0 and 1), generates `max_new_tokens` with plain decoding, with the demo draft
model and with the head, both at a fixed K (`LLM(..., spec_length=K)`), and reports the
engine's acceptance statistics: the acceptance rate (accepted drafts / K a round) and the
tokens a round (accepted drafts + the bonus or recovered token), each averaged over the
rounds of every prompt; at T=0 also whether every output equals plain decoding's. The
drafts' cost against the target: c_bytes, the weights a step reads (the head's own
matrices; the embedding it shares is a one-row lookup) over the target's, and c_time, a
timed batch-1 one-token step of each (median of `repeats`, no cache) over the target's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from demo_pair.completions import PROMPTS
from infer.engine.loading import demo_model_path
from infer.llm import LLM
from infer.models.eagle import EagleHead
from infer.models.layers.attention import NoCacheView
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.eagle_files import load_eagle_head
from infer.models.loading.loader import load_model
from infer.sampling import SamplingParams

DEFAULT_K = 5
DEFAULT_MAX_NEW_TOKENS = 96


def run_config(llm: LLM, temperature: float, max_new_tokens: int, prompts: tuple[str, ...]) -> dict[str, Any]:
    """Generate every prompt; acceptance and tokens a round over all rounds, and the outputs."""
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=i) for i in range(len(prompts))]
    outs = llm.generate(list(prompts), params)
    rounds = accepted = emitted = 0.0
    for out in outs:
        c = out.outputs[0]
        if c.mean_accepted_length:
            n = len(c.token_ids) / c.mean_accepted_length  # this request's rounds
            rounds, emitted = rounds + n, emitted + len(c.token_ids)
            accepted += (c.acceptance_rate or 0.0) * n
    row: dict[str, Any] = {"tokens": [o.outputs[0].token_ids for o in outs]}
    if rounds:
        row.update(acceptance_rate=accepted / rounds, tokens_per_round=emitted / rounds)
    return row


def compare(target: str, draft: str, head: str, k: int, max_new_tokens: int,
            prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """{"t0": {...}, "t1": {...}}: plain, draft model and head rows at each temperature."""
    setups = {"plain": {}, "draft_model": {"use_speculative_decoding": True, "draft_model": draft, "spec_length": k},
              "eagle3": {"use_speculative_decoding": True, "speculative_method": "eagle3", "draft_model": head,
                         "spec_length": k}}
    results: dict[str, Any] = {}
    for name, options in setups.items():
        with LLM(target, device="cpu", **options) as llm:
            for t in (0.0, 1.0):
                results.setdefault(f"t{t:g}", {})[name] = run_config(llm, t, max_new_tokens, prompts)
    plain = results["t0"]["plain"]["tokens"]
    for name in ("draft_model", "eagle3"):
        results["t0"][name]["greedy_equals_plain"] = results["t0"][name]["tokens"] == plain
    return results


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def step_costs(target: LlamaForCausalLM, draft: LlamaForCausalLM, head: EagleHead, repeats: int) -> dict[str, float]:
    """c by weight bytes and by timed one-token steps (batch 1, CPU), draft and head."""
    ids, pos = torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    features = torch.zeros(1, 1, head.spec.hidden_size)

    def head_step() -> None:
        head.logits(head(ids, features, pos, NoCacheView())[0])

    def nbytes(m: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    t_target = _median_seconds(lambda: target(ids, pos), repeats)
    return {"head_parameters": sum(p.numel() for p in head.parameters()),
            "head_bytes_bf16": 2 * sum(p.numel() for p in head.parameters()),
            "c_bytes_head": nbytes(head) / nbytes(target), "c_bytes_draft": nbytes(draft) / nbytes(target),
            "c_time_head": _median_seconds(head_step, repeats) / t_target,
            "c_time_draft": _median_seconds(lambda: draft(ids, pos), repeats) / t_target,
            "target_step_ms": 1e3 * t_target}


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, draft, head = args.target, args.draft, args.head
    results: dict[str, Any] = {"k": args.k, "max_new_tokens": args.max_new_tokens, "prompts": len(PROMPTS),
                               "threads": torch.get_num_threads()}
    t_model = load_model(target, dtype=torch.float32, device="cpu")[0]
    results["costs"] = step_costs(t_model, load_model(draft, dtype=torch.float32, device="cpu")[0],
                                  load_eagle_head(head, "eagle3", t_model), args.repeats)
    results.update(compare(target, draft, head, args.k, args.max_new_tokens))
    for t in ("t0", "t1"):
        for name, row in results[t].items():
            if "acceptance_rate" in row:
                print(f"T={t[1:]} {name}: acceptance {row['acceptance_rate']:.3f}, tokens a round "
                      f"{row['tokens_per_round']:.2f}" + (f", greedy = plain: {row['greedy_equals_plain']}"
                                                         if "greedy_equals_plain" in row else ""))
    print(json.dumps(results["costs"]))
    if args.out:  # (without the generated tokens: their parity is the record)
        kept = {k: ({n: {f: v for f, v in row.items() if f != "tokens"} for n, row in v.items()}
                    if k in ("t0", "t1") else v) for k, v in results.items()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(kept, indent=1) + "\n", encoding="utf-8")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo_pair.eagle_eval", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="default: the shipped demo target")
    p.add_argument("--draft", default=None, help="default: the shipped demo draft")
    p.add_argument("--head", default=None, help="default: the shipped demo EAGLE-3 head")
    p.add_argument("--k", type=int, default=DEFAULT_K)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=50, help="timed steps for c")
    p.add_argument("--out", help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.target = args.target or str(demo_model_path("target"))
    args.draft = args.draft or str(demo_model_path("draft"))
    args.head = args.head or str(demo_model_path("eagle3"))
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
