"""Logits over a kept subset of a vocabulary: a head that computes only some rows of its
lm_head (EAGLE-3's draft vocabulary, `models/eagle.py`; a draft model's reduced vocabulary,
`LlamaForCausalLM.keep_vocab`) and spreads them into the full vocabulary's columns, -inf
elsewhere, so a draft's q is zero outside the kept rows and rejection sampling stays exact.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.models.layers.linear import LinearBase


def spread_logits(small: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """small [M, N] logits of vocabulary ids `ids` [N] (distinct) -> [M, V]: column ids[j]
    holds small[:, j], every other column -inf (no host sync: CUDA graphs capture it)."""
    out = small.new_full((*small.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, ids, small)


def gathered_head(lm_head: LinearBase, ids: torch.Tensor, dtype: torch.dtype) -> LinearBase:
    """A new unquantized head of `lm_head`'s rows `ids` [N] (W [N, H] in `dtype`, on its
    device): made once at load, it reads N / V of the whole head's bytes a step."""
    if lm_head.parallel.kind != "replicated" or lm_head.bias is not None:
        raise ValueError("a reduced draft vocabulary needs the draft's whole lm_head (no bias, not split over "
                         "ranks): load the draft whole (tensor_parallel_draft='driver')")
    whole = lm_head.dense_weight(dtype)  # [V, H]
    rows = whole.index_select(0, ids.to(whole.device))  # [N, H]
    with torch.device(rows.device):  # (its random initialisation, replaced at once, on that device)
        head = LinearBase(lm_head.in_features, int(ids.numel()))
    head.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
    return head
