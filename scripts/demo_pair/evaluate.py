"""Evaluate the demo pair: `python -m demo_pair.evaluate --target DIR --draft DIR`.

Teacher-forced on the validation split (every token after the first of the stream, in
chunks of the models' context length): each model's loss and perplexity; the paper's
alpha = E[sum_x min(p(x), q(x))] at temperature 1 (Corollary 3.6; p target, q draft) and
the greedy agreement P(argmax p = argmax q) (alpha at temperature 0); the same two for
unigram and bigram models fitted on the training split with add-k smoothing (the baselines
of Table 3), and the walltime factor of Theorem 3.8 they imply with c = the layer ratio.
Writes the results JSON, greedy completions of a dozen code prompts (`demo_pair.completions`:
raw, cut at the end of the prompt's block, and scored for repetition), and README.md model
cards in both model directories.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from demo_pair.bpe import encode_documents, load_tokenizer
from demo_pair.completions import PROMPTS, complete_all
from demo_pair.data import batch_chunks, read_texts, validation_chunks
from demo_pair.metrics import (
    PairTotals,
    expected_tokens,
    fit_bigram,
    fit_unigram,
    walltime_factor,
)
from demo_pair.model_card import write_cards
from demo_pair.trainer import autocast, forward_logits
from infer.corpus import split_corpus
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.loader import load_model

DEFAULT_K = 0.01
DEFAULT_MAX_NEW_TOKENS = 128
EVAL_BATCH = 8
GAMMAS = (1, 2, 3, 4, 5, 6, 7, 8)


def evaluate_pair(target: LlamaForCausalLM, draft: LlamaForCausalLM, train: torch.Tensor,
                  valid: torch.Tensor, device: torch.device, k: float = DEFAULT_K) -> dict[str, Any]:
    """Teacher-forced metrics on `valid` [N]; n-gram baselines fitted on `train` [M]."""
    vocab = target.config.vocab_size
    if draft.config.vocab_size != vocab:
        raise ValueError(f"target and draft vocabularies differ ({vocab} vs "
                         f"{draft.config.vocab_size}): a speculative pair must share its tokenizer")
    bigram = fit_bigram(train, vocab, k).to(device)  # [V, V]
    unigram = fit_unigram(train, vocab, k).to(device)  # [V]
    pair, bi, uni = PairTotals(), PairTotals(), PairTotals()
    seq_len = min(target.config.max_position_embeddings, draft.config.max_position_embeddings)
    with torch.no_grad():
        for batch in batch_chunks(validation_chunks(valid, seq_len), EVAL_BATCH):
            batch = batch.to(device)
            inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
            with autocast(device):
                log_p = F.log_softmax(forward_logits(target, inputs).flatten(0, 1), dim=-1)  # [N, V]
                log_q = F.log_softmax(forward_logits(draft, inputs).flatten(0, 1), dim=-1)
            pair.add(log_p, log_q, labels)
            bi.add(log_p, bigram[inputs.reshape(-1)].log(), labels)
            uni.add(log_p, unigram.log().expand_as(log_p), labels)
    return _results(target, draft, pair.summary(), bi.summary(), uni.summary(), k)


def _results(target: LlamaForCausalLM, draft: LlamaForCausalLM, pair: dict[str, float],
             bi: dict[str, float], uni: dict[str, float], k: float) -> dict[str, Any]:
    c = draft.config.num_hidden_layers / target.config.num_hidden_layers

    def model_row(m: LlamaForCausalLM, loss: float) -> dict[str, Any]:
        return {"loss": loss, "perplexity": math.exp(loss), "num_parameters": m.config.num_parameters(),
                "layers": m.config.num_hidden_layers, "hidden_size": m.config.hidden_size}

    def baseline(s: dict[str, float]) -> dict[str, float]:
        return {"alpha": s["alpha"], "greedy_agreement": s["greedy_agreement"], "loss": s["draft_loss"]}

    speedup = {str(g): {
        "tokens_per_call_t1": expected_tokens(pair["alpha"], g),
        "walltime_factor_t1": walltime_factor(pair["alpha"], g, c),
        "tokens_per_call_t0": expected_tokens(pair["greedy_agreement"], g),
        "walltime_factor_t0": walltime_factor(pair["greedy_agreement"], g, c),
    } for g in GAMMAS}
    return {
        "positions": pair["positions"],
        "target": model_row(target, pair["target_loss"]),
        "draft": model_row(draft, pair["draft_loss"]),
        "draft_vs_target": {"alpha": pair["alpha"], "greedy_agreement": pair["greedy_agreement"]},
        "bigram_vs_target": baseline(bi),
        "unigram_vs_target": baseline(uni),
        "smoothing_k": k,
        "cost_ratio_c": c,
        "theorem_3_8": speedup,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device if args.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    target, _ = load_model(args.target, dtype=torch.float32, device=device)
    draft, _ = load_model(args.draft, dtype=torch.float32, device=device)
    tok = load_tokenizer(args.target)
    if load_tokenizer(args.draft).to_str() != tok.to_str():
        raise ValueError(f"{args.draft} and {args.target} have different tokenizer.json files: "
                         "a speculative pair must share one tokenizer")
    split = split_corpus()
    train_files, valid_files = split.train, split.valid
    if args.max_files:
        train_files, valid_files = train_files[:args.max_files], valid_files[:max(2, args.max_files // 10)]
    train = encode_documents(tok, read_texts(train_files))
    valid = encode_documents(tok, read_texts(valid_files))
    results = evaluate_pair(target, draft, train, valid, device, args.k)
    results["validation"] = {"files": len(valid_files), "tokens": int(valid.numel()),
                             "python_version": split.python_version}
    results["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                              "device": str(device), **({"gpu": torch.cuda.get_device_name(device)}
                                                        if device.type == "cuda" else {})}
    results["max_new_tokens"] = args.max_new_tokens
    results["completions"] = {
        role: complete_all(m, tok, PROMPTS, args.max_new_tokens, device)
        for role, m in (("target", target), ("draft", draft))}
    _print_summary(results)
    out = Path(args.out) if args.out else Path(args.target).parent / "eval_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if not args.no_cards:
        write_cards(Path(args.target), Path(args.draft), results)
    return results


def _print_summary(r: dict[str, Any]) -> None:
    print(f"validation positions {r['positions']}")
    for role in ("target", "draft"):
        print(f"{role}: loss {r[role]['loss']:.4f} ppl {r[role]['perplexity']:.2f}")
    for name in ("draft_vs_target", "bigram_vs_target", "unigram_vs_target"):
        print(f"{name}: alpha(T=1) {r[name]['alpha']:.4f} greedy agreement {r[name]['greedy_agreement']:.4f}")
    for c in r["completions"]["target"]:
        print(f"--- target greedy (repetition {c['repetition']:.2f}): {c['prompt']!r}\n"
              f"{c['prompt']}{c['shown']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m demo_pair.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--draft", required=True, help="draft model directory")
    p.add_argument("--out", help="results JSON path (default: TARGET/../eval_results.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--k", type=float, default=DEFAULT_K, help="add-k smoothing of the n-gram baselines")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--max-files", type=int, help="corpus subset (smoke runs)")
    p.add_argument("--no-cards", action="store_true", help="do not write README.md model cards")
    return p


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
