"""README.md model cards of the demo target and draft, from training summaries and eval results.

Everything in a card comes from `training_summary.json` (written by training next to the
weights) and the evaluation results; nothing is typed in by hand, so a rerun refreshes it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from demo_pair.completions import MAX_REPETITION, pick_examples
from demo_pair.saving import read_summary
from infer.corpus import MAX_FILE_BYTES

REPRODUCE = """\
PYTHONPATH=src:scripts python -m demo_pair --out src/infer/demo_models --log-dir runs/demo_pair
# or step by step:
PYTHONPATH=src:scripts python -m demo_pair.train --out src/infer/demo_models
PYTHONPATH=src:scripts python -m demo_pair.evaluate --target src/infer/demo_models/target \\
    --draft src/infer/demo_models/draft --out runs/demo_pair/eval_results.json"""
SHOWN_COMPLETIONS = 2


def write_cards(target_dir: Path, draft_dir: Path, results: dict[str, Any]) -> None:
    for role, directory in (("target", target_dir), ("draft", draft_dir)):
        text = render_card(role, read_summary(directory), results, directory)
        (directory / "README.md").write_text(text, encoding="utf-8")


def render_card(role: str, summary: dict[str, Any], results: dict[str, Any], directory: Path) -> str:
    parts = [_header(role, summary, results), _model(role, directory, results),
             _data(summary), _tokenizer(directory), _training(role, summary),
             _evaluation(results), _completions(role, results),
             "## Reproduce\n\n```bash\n" + REPRODUCE + "\n```\n", _licence()]
    return "\n".join(parts)


def _header(role: str, s: dict[str, Any], r: dict[str, Any]) -> str:
    n = r[role]["num_parameters"]
    version = s.get("corpus", {}).get("python_version", "?")
    other = "draft" if role == "target" else "target"
    job = ("verifies the draft's proposals" if role == "target"
           else "proposes tokens that the target verifies")
    return (
        "---\nlicense: mit\nlibrary_name: infer\npipeline_tag: text-generation\n"
        "tags: [llama, code, speculative-decoding, demo]\n---\n\n"
        f"# infer demo {role}: a {n / 1e6:.1f} M-parameter Llama trained on the Python "
        f"{version} standard library\n\n"
        f"The {role} of the `infer` project's demo speculative-decoding pair: it {job} "
        f"(the {other} lives in `../{other}`). It is a toy built to exercise and measure "
        "the engine (acceptance rates need trained models; random weights accept nothing), "
        "not to write useful code. Both models share one tokenizer and load with "
        "`infer.models.loading.loader.load_model` and `transformers.LlamaForCausalLM.from_pretrained`.\n")


def _model(role: str, directory: Path, r: dict[str, Any]) -> str:
    import json  # local: config.json is the source of truth for the shape
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    size = sum((directory / s).stat().st_size for s in shards)
    rows = [
        ("architecture", ("LlamaForCausalLM (RMSNorm, SwiGLU, RoPE, grouped-query attention), "
                          "tied embeddings")),
        ("parameters", f"{r[role]['num_parameters']:,}"),
        ("layers / hidden / intermediate",
         f"{cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['intermediate_size']}"),
        ("attention heads / KV heads / head dim",
         f"{cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']}"),
        ("context length", f"{cfg['max_position_embeddings']} (the training sequence length)"),
        ("RoPE", f"theta {cfg['rope_theta']:g}, no scaling"),
        ("vocabulary", f"{cfg['vocab_size']} (byte-level BPE, shared by target and draft)"),
        ("weights", (f"{cfg.get('torch_dtype', '?')} safetensors, {len(shards)} shards + index, "
                     f"{size / 1e6:.1f} MB")),
    ]
    table = "| | |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    return (
        "## Model\n\n" + table + "\n\n"
        f"Layer counts: target {r['target']['layers']}, draft {r['draft']['layers']}, ratio "
        f"{r['cost_ratio_c']:.3f}; Llama-3.2-1B / 3B have 16 / 28 = 0.571. At batch 1 on a "
        "GPU, models this small are bound by kernel launches, so a forward pass costs about the "
        "same per layer whatever the width, and the paper's cost coefficient c (Definition 3.7) "
        "is about the layer ratio, which makes a 4 / 7-layer pair cost like a 1B draft for a "
        "3B target.\n")


def _data(s: dict[str, Any]) -> str:
    c = s.get("corpus", {})
    if not c:
        return "## Data\n\n(no training summary found)\n"
    subset = f" (smoke run: first {c['subset_of_files']} files only)" if c.get("subset_of_files") else ""
    return (
        "## Data\n\n"
        f"The `.py` files of the CPython {c['python_version']} standard library "
        f"(`{c['stdlib_root']}`; build: `{c['python_build']}`){subset}, chosen by "
        "`infer.corpus`: no site-packages, no test suites (`test`, `tests`, `idle_test`), "
        "no generated tables or documents (character-map codecs, `pydoc_data/topics.py`), no "
        f"file over {MAX_FILE_BYTES // 1024} KiB, no build configuration, duplicates (same "
        "sha256) kept once. Split by sha256 of the path relative to the stdlib root: about 5 % "
        "of files to validation.\n\n"
        "| split | files | bytes | tokens |\n|---|---|---|---|\n"
        f"| train | {c['train_files']} | {c['train_bytes']:,} | {c['train_tokens']:,} |\n"
        f"| validation | {c['valid_files']} | {c['valid_bytes']:,} | {c['valid_tokens']:,} |\n\n"
        "Each file is encoded as BOS + text + EOS; files are concatenated into one stream and "
        "cut into training sequences (attention crosses file boundaries, as in packed "
        "pre-training).\n")


def _tokenizer(directory: Path) -> str:
    return (
        "## Tokenizer\n\n"
        "Byte-level BPE trained with `tokenizers` on the training split only: Llama 3's "
        "pre-tokenizer regex, then GPT-2's byte mapping, so any text encodes and decodes "
        "exactly. Special tokens `<|bos|>` = 0, `<|eos|>` = 1, `<|pad|>` = 2; BOS is added "
        "to every encoded text (`add_bos_token: true`, and the tokenizer.json post-processor). "
        "The chat template renders messages as Python comments (the model has never seen a "
        "chat; the template only makes `chat` well formed).\n")


def _training(role: str, s: dict[str, Any]) -> str:
    log = s.get("log")
    if not log:
        return "## Training\n\n(no training summary found)\n"
    st, env = log["settings"], s.get("environment", {})
    if s.get("distilled_from"):
        objective = (f"distillation from the trained target (loaded back from its bf16 files): "
                     f"{st['distill_weight']:g} x KL(p_target || q_draft) + "
                     f"{1 - st['distill_weight']:g} x cross-entropy, temperature 1. The paper's "
                     "alpha = E[sum min(p, q)] rewards a draft that matches the target's "
                     "distribution, which is what the KL term trains for")
    else:
        objective = "next-token cross-entropy"
    hw = env.get("gpu") or env.get("cpu", "?")
    seq = s.get("seq_len", 0)
    text = (
        "## Training\n\n"
        f"- objective: {objective}\n"
        f"- AdamW (betas {tuple(st['betas'])}, weight decay {st['weight_decay']} on matrices), "
        f"peak lr {st['lr']:g}, {st['warmup_steps']} warm-up steps, cosine to "
        f"{st['min_lr_ratio']:g} x peak, gradient clip {st['grad_clip']}, residual dropout {st['dropout']}\n"
        f"- {log['total_steps']} steps of {st['batch_size']} x {seq} tokens "
        f"({log['tokens_seen']:,} tokens; {st['epochs']:g} epoch(s) planned), bf16 autocast, "
        f"seed {s.get('seed')}\n"
        f"- {log['seconds']:.0f} s wall time of the training loop on {hw} (torch {env.get('torch')}, "
        f"Python {env.get('python')}; longer than a lone run's where several recipes shared the "
        "GPU, as in scripts/demo_pair/sweep.py)\n"
        f"- {_selection(log, st)}\n\n")
    return text + _curve(log)


def _selection(log: dict[str, Any], st: dict[str, Any]) -> str:
    if st.get("select") != "best":
        return f"weights after the last step ({log['total_steps']})"
    return (f"weights of step {log['selected_step']} of {log['total_steps']}: the lowest "
            f"{log['selected_by']} among checks every {st['eval_every']} steps (early stopping on "
            "the validation split, so the validation numbers below are very slightly optimistic)")


def _curve(log: dict[str, Any], rows: int = 8) -> str:
    valid = log.get("valid", [])
    if not valid:
        return ""
    stride = max(len(valid) // rows, 1)
    picked = valid[::stride]
    if picked[-1] is not valid[-1]:
        picked.append(valid[-1])
    train = {row["step"]: row.get("ce", row["loss"]) for row in log.get("train", [])}
    extra = "alpha" in valid[0]
    head = "| step | train loss | validation loss |" + (" val KL | val alpha |" if extra else "")
    sep = "|---|---|---|" + ("---|---|" if extra else "")
    lines = [head, sep]
    for row in picked:
        tr = train.get(row["step"])
        cells = [str(row["step"]), f"{tr:.3f}" if tr is not None else "", f"{row['loss']:.3f}"]
        if extra:
            cells += [f"{row['kl']:.3f}", f"{row['alpha']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return ("Validation during training (train loss: mean of the last 10 steps, cross-entropy):"
            "\n\n" + "\n".join(lines) + "\n")


def _evaluation(r: dict[str, Any]) -> str:
    t, d = r["target"], r["draft"]
    rows = [("draft (this pair)", r["draft_vs_target"]), ("bigram, add-k", r["bigram_vs_target"]),
            ("unigram, add-k", r["unigram_vs_target"])]
    table = "| draft q | alpha, T=1 | greedy agreement (alpha, T=0) |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {m['alpha']:.3f} | {m['greedy_agreement']:.3f} |" for name, m in rows)
    speed = ("| gamma | tokens per target call, T=1 | walltime factor, T=1 | walltime factor, T=0 |"
             "\n|---|---|---|---|\n")
    speed += "\n".join(
        f"| {k} | {v['tokens_per_call_t1']:.2f} | {v['walltime_factor_t1']:.2f} | "
        f"{v['walltime_factor_t0']:.2f} |"
        for k, v in r["theorem_3_8"].items() if k in ("1", "2", "3", "4", "6", "8"))
    return (
        "## Evaluation\n\n"
        f"Teacher forced on the validation split ({r['positions']:,} predicted tokens; "
        f"{r['validation']['files']} files), "
        f"{r['environment'].get('gpu') or r['environment']['device']}.\n\n"
        "| model | validation loss (nats/token) | perplexity |\n|---|---|---|\n"
        f"| target | {t['loss']:.4f} | {t['perplexity']:.2f} |\n"
        f"| draft | {d['loss']:.4f} | {d['perplexity']:.2f} |\n\n"
        f"{_gap(t['loss'], d['loss'])}\n\n"
        "Acceptance against the target p (Leviathan et al., Corollary 3.6: alpha = E[sum_x "
        "min(p(x), q(x))], averaged over all validation positions; the n-gram baselines are "
        f"fitted on the training split with k = {r['smoothing_k']:g}, as in Table 3):\n\n"
        + table + "\n\n"
        f"What that implies under the paper's i.i.d. model (Equation 1, Theorem 3.8) with c = "
        f"{r['cost_ratio_c']:.3f} (layer ratio):\n\n" + speed + "\n")


def _gap(target_loss: float, draft_loss: float) -> str:
    gap = draft_loss - target_loss
    where = "below" if gap > 0 else "above"
    return (f"The target's validation loss is {abs(gap):.3f} nats/token {where} the draft's "
            f"(perplexity ratio {math.exp(gap):.3f}).")


def _completions(role: str, r: dict[str, Any]) -> str:
    rows = r.get("completions", {}).get(role, [])
    if not rows:
        return f"## Greedy completions ({role})\n\n(none recorded)\n"
    picked = pick_examples(rows, SHOWN_COMPLETIONS)
    others = [i for i in range(len(rows)) if i not in picked]

    def block(row: dict[str, Any]) -> str:
        text = row["prompt"] + row.get("shown", row["completion"])
        return (f"repetition {row['repetition']:.2f}:\n\n" if "repetition" in row else "") + \
            "```python\n" + text.rstrip("\n") + "\n```"

    limit = r.get("max_new_tokens", "?")
    text = (f"## Greedy completions ({role})\n\n"
            f"Greedy decoding with this model alone (no sampling, no repetition penalty), at most "
            f"{limit} new tokens, stopping at EOS. Each block is the prompt followed by the model's "
            "continuation up to the end of the prompt's top-level block (the first later line "
            "that starts in column 0). Repetition is the share of repeated word 3-grams. Shown "
            f"first: {len(picked)} of the {len(rows)} prompts, the longest continuations that "
            f"repeat little (repetition <= {MAX_REPETITION:g}, else the least repetitive); the "
            "others are in the folded section below.\n\n" + "\n\n".join(block(rows[i]) for i in picked) + "\n")
    if others:
        text += ("\n<details><summary>The other prompts</summary>\n\n"
                 + "\n\n".join(block(rows[i]) for i in others) + "\n\n</details>\n")
    return text


def _licence() -> str:
    return (
        "## Licence\n\n"
        "Training data: the CPython standard library, distributed under the PSF License "
        "Agreement (https://docs.python.org/3/license.html). The weights are part of the "
        "`infer` package (MIT licence, see pyproject.toml).\n")
