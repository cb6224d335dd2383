"""Exact and empirical joint distributions of a request's first tokens (losslessness tests).

On a tiny vocabulary the exact joint distribution of the first `length` sampled tokens is
enumerable from the target model; a speculative engine's empirical distribution over many
seeded requests must be within sampling noise of it (total variation).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from helpers.checkpoints import family_model, write_tokenizer
from infer import SamplingParams
from infer.models.loading.loader import load_model
from infer.sampling import logits_to_probs

Joint = dict[tuple[int, ...], float]


def tiny_model(directory: Path, vocab: int, seed: int, layers: int = 2, family: str = "llama",
               **overrides: Any) -> Path:
    """A checkpoint of `family` (helpers.checkpoints.FAMILIES; Llama: variant "b") with a
    `vocab`-token vocabulary (bos 0, eos 1) and random weights."""
    write_tokenizer(directory)
    family_model(family, vocab, 0, 1, seed, num_hidden_layers=layers, **overrides).save_pretrained(directory)
    return directory


def exact_joint(model_dir: Path, prompt: list[int], params: SamplingParams, vocab: int, length: int = 3) -> Joint:
    """P(first `length` tokens = seq) for every seq, by the sampling pipeline on the target."""
    model, _ = load_model(str(model_dir), dtype="float32")
    joint: Joint = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            p = 1.0
            for i in range(length):
                ctx = prompt + list(seq[:i])
                logits = model(torch.tensor([ctx]))[:, -1]
                p *= logits_to_probs(logits, [params], [ctx])[0, seq[i]].item()
            joint[seq] = p
    return joint


def empirical_joint(outputs: list[Any], length: int = 3) -> Joint:
    """The frequency of each first-`length`-token sequence among LLM outputs."""
    counts: Joint = {}
    for o in outputs:
        key = tuple(o.outputs[0].token_ids[:length])
        counts[key] = counts.get(key, 0.0) + 1 / len(outputs)
    return counts


def seeded(params: SamplingParams, n: int, max_tokens: int = 4) -> list[SamplingParams]:
    return [replace(params, max_tokens=max_tokens, ignore_eos=True, seed=s) for s in range(n)]


def total_variation(a: Joint, b: Joint) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def tiny_pair(factory: Any, vocab: int) -> tuple[Path, Path]:
    """(target, draft) checkpoints of the lossless tests: two layers against one, other seeds.
    `factory`: pytest's tmp_path_factory."""
    return (tiny_model(factory.mktemp("t"), vocab, seed=1), tiny_model(factory.mktemp("d"), vocab, seed=2, layers=1))


def force_first_child(monkeypatch: Any) -> None:
    """The trees' negative control: uniforms of 0 pass every acceptance test, so the first
    child is always accepted (the final token is still drawn from the residual)."""
    import infer.engine.verification as verification
    import infer.speculative.verifier as verifier
    real = verifier.verify_tree_nodes

    def first_child(shape, node_tokens, draft_probs, target_probs, uniforms, node_valid=None):  # type: ignore[no-untyped-def]
        rigged = torch.cat([torch.zeros_like(uniforms[:, :-1]), uniforms[:, -1:]], dim=1)
        return real(shape, node_tokens, draft_probs, target_probs, rigged, node_valid)

    monkeypatch.setattr(verifier, "verify_tree_nodes", first_child)
    monkeypatch.setattr(verification, "verify_tree_nodes", first_child)


def force_accept_all(monkeypatch: Any) -> None:
    """The chains' negative control: uniforms of 0 pass every acceptance test, so every draft
    is accepted (the bonus token is still sampled from p). Both verification paths (fused
    and general) end in `verifier.verify_tensors`."""
    import infer.speculative.verifier as verifier
    real = verifier.verify_tensors

    def accept_all(draft_tokens, counts, draft_probs, target_probs, accept_u, sample_u):  # type: ignore[no-untyped-def]
        return real(draft_tokens, counts, draft_probs, target_probs, torch.zeros_like(accept_u), sample_u)

    monkeypatch.setattr(verifier, "verify_tensors", accept_all)


def speculative_tv(make_llm: Any, target: Path, prompt: list[int], vocab: int, n: int,
                   **engine: Any) -> tuple[float, Any]:
    """(total variation between the first 3 tokens of n seeded T=1 requests for `prompt`
    and the target's exact joint distribution, the LLM): the lossless tests' measure, on an
    engine of `engine` options (max_seq_len 16 unless given)."""
    params = SamplingParams(temperature=1.0)
    exact = exact_joint(target, prompt, params, vocab)
    llm = make_llm(target, **{"max_seq_len": 16, "use_speculative_decoding": True, "spec_batch_gate": False, **engine})
    outputs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=seeded(params, n))
    return total_variation(empirical_joint(outputs), exact), llm
