"""Greedy tokens of two GPU runs compared up to near-ties: the runs must agree, except from a
first divergence where a reference model's own logits (a forward of the prefix without a
cache) put the two tokens within NEAR_TIE of each other (kernels that sum in another order
may pick either of two tied tokens; anywhere else a difference is a bug)."""

from __future__ import annotations

import torch

NEAR_TIE = 0.125  # bf16 logits near 16 are 0.0625 apart: a gap of two roundings is a tie

Tokens = list[tuple[list[int], list[int]]]  # (prompt ids, greedy tokens) per prompt


def check_same_up_to_near_ties(model: torch.nn.Module, prompts: list[str], got: Tokens, want: Tokens) -> None:
    """got == want, except from a first divergence that `model` sees as a near-tie."""
    for prompt, (p, g), (pw, w) in zip(prompts, got, want, strict=True):
        assert p == pw
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if i is None:
            assert len(g) == len(w)
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + w[:i]], device="cuda"))[0, -1].float()  # [V]
        gap = (logits[w[i]] - logits[g[i]]).abs().item()
        print(f"{prompt!r}: diverged at token {i}, reference logit gap {gap:.4f}")
        assert gap <= NEAR_TIE, f"{prompt!r}: the runs' tokens differ at {i} where the reference sees no tie"
