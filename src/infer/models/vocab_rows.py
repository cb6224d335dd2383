"""Logits over a kept subset of a vocabulary (EAGLE-3's draft vocabulary, `keep_vocab`), spread
into the full vocabulary with -inf elsewhere, so a draft's q is zero outside the kept rows.
"""

from __future__ import annotations

import torch

from infer.models.layers.linear import LinearBase, quant_method


def spread_logits(small: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """small [M, N] logits of vocabulary ids `ids` [N] (distinct) -> [M, V]: column ids[j]
    holds small[:, j], every other column -inf (no host sync: CUDA graphs capture it)."""
    out = small.new_full((*small.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, ids, small)


def head_quantization(quantization: str | None) -> str | None:
    """How a gathered head is stored: "fp8" for an FP8 model, "int8" for int4 / int8, else None (dtype)."""
    return {"fp8": "fp8", "int4": "int8", "int8": "int8"}.get(quantization or "")


def gathered_head(lm_head: LinearBase, ids: torch.Tensor, dtype: torch.dtype,
                  quantization: str | None = None) -> LinearBase:
    """A new head of `lm_head`'s rows `ids` [N] (W [N, H], on its device) stored as `quantization`
    says (None: in `dtype`), its other parameters in `dtype`."""
    if lm_head.parallel.kind != "replicated" or lm_head.bias is not None:
        raise ValueError("a reduced draft vocabulary needs the draft's whole lm_head (no bias, not split over "
                         "ranks): load the draft whole (tensor_parallel_draft='driver')")
    whole = lm_head.dense_weight(dtype)  # [V, H]
    rows = whole.index_select(0, ids.to(whole.device)).contiguous()  # [N, H]
    method = quant_method(quantization, lm_head.in_features)
    with torch.device(rows.device):  # (its random initialisation, replaced at once, on that device)
        head = LinearBase(lm_head.in_features, int(ids.numel()), method)
    for name, param in head.named_parameters():
        if param.is_floating_point() and name not in method.fixed_dtype_params:
            param.data = param.data.to(dtype)
    method.load_weight(head, rows, None, "lm_head")
    return head
