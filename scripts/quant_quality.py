"""Quality of quantized weights on a trained pair (FP8 and int4 by default), against the
bf16/fp32 models, on a text the pair did not train on verbatim:

- teacher-forced over the text: the quantized target's top-1 agreement with the dense
  target, KL(p_dense || p_quantized), and both perplexities; the draft's acceptance alpha =
  E[sum_x min(p, q)] against the dense target, dense and quantized (and its greedy agreement,
  the T=0 acceptance);
- greedy: the dense target's own greedy continuation (32 tokens) of a few prompts, and the
  share of its positions where the quantized target's greedy choice is the same token.

    python scripts/quant_quality.py                      # the bundled demo pair, FP8 and int4
    python scripts/quant_quality.py --target DIR --draft DIR --text FILE --device cuda --quantizations int4
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from infer.models.loading.loader import load_model  # noqa: E402
from infer.speculative.theory import expected_tokens  # noqa: E402
from infer.tokenization import Tokenizer  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# read a file and count its words\n"]
GREEDY_TOKENS = 32


def demo_text() -> str:
    """Python source and prose the demo pair did not train on verbatim: its model cards and
    this project's own code."""
    root = Path(__file__).resolve().parent.parent / "src" / "infer"
    return "\n".join(p.read_text() for p in [DEMO_TARGET / "README.md", root / "speculative" / "verifier.py",
                                             root / "engine" / "scheduler.py"])


@torch.no_grad()
def log_probs(model: torch.nn.Module, ids: torch.Tensor, window: int = 512) -> torch.Tensor:
    """[T, V] next-token log-probabilities over windows of `window` tokens."""
    out = []
    for start in range(0, ids.shape[0], window):
        chunk = ids[start:start + window][None]
        out.append(model(chunk)[0].float().log_softmax(-1))
    return torch.cat(out)


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy continuation of GREEDY_TOKENS tokens (no cache: tiny models)."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(GREEDY_TOKENS):
            ids.append(int(model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out


@torch.no_grad()
def greedy_agreement(model: torch.nn.Module, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The share of the continuations' positions where `model`'s greedy choice (given the
    same prefix) is the continuation's token."""
    agree = total = 0
    for prompt, new in zip(prompts, continuations, strict=True):
        ids = torch.tensor([prompt + new[:-1]], device=next(model.parameters()).device)
        picks = model(ids)[0, len(prompt) - 1:].argmax(-1).cpu()
        agree += int((picks == torch.tensor(new)).sum())
        total += len(new)
    return agree / total


def perplexity(lp: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(-lp[:-1].gather(1, ids[1:, None]).mean().item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(DEMO_TARGET))
    ap.add_argument("--draft", default=str(DEMO_DRAFT))
    ap.add_argument("--text", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--quantizations", nargs="+", default=["fp8", "int4"], choices=["fp8", "int4"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tok = Tokenizer.from_pretrained(args.target)
    text = args.text.read_text() if args.text else demo_text()
    ids = torch.tensor(tok.encode(text)[:args.max_tokens], device=args.device)
    prompts = [tok.encode(p) for p in PROMPTS]
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    target, _ = load_model(args.target, dtype=dtype, device=args.device)
    lp_t = log_probs(target, ids)
    continuations = greedy_continuations(target, prompts)
    del target
    p = lp_t.exp()
    draft, _ = load_model(args.draft, dtype=dtype, device=args.device)
    lp_d = log_probs(draft, ids)
    del draft
    out = {"tokens": int(ids.numel()), "device": args.device, "dtype": dtype, "target_perplexity": perplexity(lp_t, ids),
           "draft_alpha": torch.minimum(p, lp_d.exp()).sum(-1).mean().item(),
           "draft_greedy_agreement": (lp_t.argmax(-1) == lp_d.argmax(-1)).float().mean().item(),
           "greedy_prompts": len(prompts), "greedy_tokens": GREEDY_TOKENS}
    for q in args.quantizations:
        model, _ = load_model(args.target, dtype=dtype, device=args.device, quantization=q)
        lp = log_probs(model, ids)
        out[f"target_{q}_greedy_agreement"] = greedy_agreement(model, prompts, continuations)
        del model
        out[f"target_{q}_top1_agreement"] = (lp_t.argmax(-1) == lp.argmax(-1)).float().mean().item()
        out[f"target_{q}_kl"] = (p * (lp_t - lp)).sum(-1).mean().item()
        out[f"target_{q}_perplexity"] = perplexity(lp, ids)
        out[f"target_{q}_perplexity_ratio"] = out[f"target_{q}_perplexity"] / out["target_perplexity"]
        draft, _ = load_model(args.draft, dtype=dtype, device=args.device, quantization=q)
        lq = log_probs(draft, ids)
        del draft
        out[f"draft_{q}_alpha"] = torch.minimum(p, lq.exp()).sum(-1).mean().item()
        out[f"draft_{q}_greedy_agreement"] = (lp_t.argmax(-1) == lq.argmax(-1)).float().mean().item()
        out[f"{q}_draft_alpha_ratio"] = out[f"draft_{q}_alpha"] / out["draft_alpha"]
        out[f"expected_tokens_k5_{q}_draft"] = expected_tokens(out[f"draft_{q}_alpha"], 5)
    out["expected_tokens_k5_draft"] = expected_tokens(out["draft_alpha"], 5)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
