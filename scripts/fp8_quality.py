"""Quality of FP8 weights on a trained pair, teacher-forced over a text: the FP8 target
against the bf16/fp32 target (top-1 agreement of the next-token argmax, KL(p_dense || p_fp8)),
and the draft's acceptance alpha = E[sum_x min(p, q)] against the target with the draft
dense and in FP8 (also greedy agreement, the T=0 acceptance).

    python scripts/fp8_quality.py                      # the bundled demo pair, on its model cards' text
    python scripts/fp8_quality.py --target DIR --draft DIR --text FILE --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from infer.models.loader import load_model  # noqa: E402
from infer.speculative.theory import expected_tokens  # noqa: E402
from infer.tokenization import Tokenizer  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(DEMO_TARGET))
    ap.add_argument("--draft", default=str(DEMO_DRAFT))
    ap.add_argument("--text", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    text = args.text.read_text() if args.text else demo_text()
    ids = torch.tensor(Tokenizer.from_pretrained(args.target).encode(text)[:args.max_tokens], device=args.device)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    lp = {}
    for name, path, quant in (("target", args.target, None), ("target_fp8", args.target, "fp8"),
                              ("draft", args.draft, None), ("draft_fp8", args.draft, "fp8")):
        model, _ = load_model(path, dtype=dtype, device=args.device, quantization=quant)
        lp[name] = log_probs(model, ids)
        del model
    p = lp["target"].exp()
    out = {"tokens": int(ids.numel()), "device": args.device, "dtype": dtype,
           "target_fp8_top1_agreement": (lp["target"].argmax(-1) == lp["target_fp8"].argmax(-1)).float().mean().item(),
           "target_fp8_kl": (p * (lp["target"] - lp["target_fp8"])).sum(-1).mean().item()}
    for name in ("draft", "draft_fp8"):
        q = lp[name].exp()
        out[f"{name}_alpha"] = torch.minimum(p, q).sum(-1).mean().item()
        out[f"{name}_greedy_agreement"] = (lp["target"].argmax(-1) == lp[name].argmax(-1)).float().mean().item()
    out["fp8_draft_alpha_ratio"] = out["draft_fp8_alpha"] / out["draft_alpha"]
    out["fp8_draft_greedy_ratio"] = out["draft_fp8_greedy_agreement"] / out["draft_greedy_agreement"]
    out["expected_tokens_k5"] = {n: expected_tokens(out[f"{n}_alpha"], 5) for n in ("draft", "draft_fp8")}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
