"""The flash prefill kernel (models/kernels/prefill_attention.py) under Triton's interpreter on the CPU,
against the gathered masked-SDPA reference (the CPU's path) on tiny shapes
(skipped without triton). Tiles of 16 x 16 so that chunks of 17-33 tokens cross query and
key tile edges. Cases: a prefix-cache hit (context cached before the
chunk); one prompt in two chunks (the second reads the first from the cache), whose outputs
together are the whole prompt's; a batch with a shorter, right-padded row; grouped-query
attention (4 query heads on 2 or 1 KV heads); head_dim 64 and 40 (padded to 64 inside). The
storage rows are paged: blocks of 4 rows in shuffled order, the scratch row last.

The interpreter must be switched on before triton.language is first imported, so the kernel
runs in a subprocess (`run_interpreted_cases`) and the comparisons here, in float32 (exact
products) and one fp16 case.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers.interpreted import interpreted_outputs
from helpers.padded_attention import padded_prefill_attention
from infer.models.layers.attention import masked_attention, position_mask

BLOCK = 4  # rows a page


@dataclass(frozen=True)
class Case:
    starts: tuple[int, ...]  # [B] tokens cached before each row's chunk
    lens: tuple[int, ...]  # [B] valid tokens of each row's chunk (the widest sets T)
    hq: int = 4
    hkv: int = 2
    d: int = 64
    dtype: torch.dtype = torch.float32


CASES = {
    "prefix-hit": Case((21,), (30,)),
    "two-chunks-1": Case((0,), (24,), hkv=1),
    "two-chunks-2": Case((24,), (26,), hkv=1),
    "padded-batch": Case((5, 0), (33, 17)),
    "head-dim-40": Case((9,), (28,), d=40),
    "fp16": Case((18,), (20,), dtype=torch.float16),
}
PROMPT_SEED = 3  # the two chunks are one prompt: one seed for both, cut at 24


def _paged_rows(total: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """(rows [total] of positions 0..total-1 in shuffled pages of BLOCK rows, scratch row)."""
    pages = -(-total // BLOCK) + 3  # a few pages nobody uses
    order = torch.randperm(pages, generator=gen)
    rows = (order[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:total]
    return rows, pages * BLOCK


def case_inputs(name: str) -> dict[str, torch.Tensor]:
    """q [B, T, Hq, D], caches [rows, Hkv, D] holding every row's context, gather_rows [B, S],
    q_pos [B, T], ctx_end [B]. A second chunk draws the whole prompt with the first's seed."""
    c = CASES[name]
    two = name.startswith("two-chunks")
    gen = torch.Generator().manual_seed(PROMPT_SEED if two else sum(map(ord, name)))
    batch, t = len(c.starts), max(c.lens)
    ends = [s + n for s, n in zip(c.starts, c.lens, strict=True)]
    s = max(ends) + 3  # gather width past the longest context (scratch there)
    total = 50 if two else sum(ends)
    k_all = torch.randn(total, c.hkv, c.d, generator=gen)
    v_all = torch.randn(total, c.hkv, c.d, generator=gen)
    q_all = torch.randn(total, c.hq, c.d, generator=gen)
    rows, scratch = _paged_rows(total, gen)
    kc = torch.full((scratch + 1, c.hkv, c.d), 1e4)  # rows nobody wrote: huge, would show up
    vc = torch.full_like(kc, 1e4)
    kc[rows], vc[rows] = k_all, v_all
    gather = torch.full((batch, s), scratch, dtype=torch.long)
    q = torch.zeros(batch, t, c.hq, c.d)
    offset = 0
    for b, (start, end) in enumerate(zip(c.starts, ends, strict=True)):
        base = 0 if two else offset  # each row its own span of the storage
        gather[b, :end] = rows[base:base + end]
        q[b, :end - start] = q_all[base + start:base + end]
        offset += end
    q_pos = torch.tensor(c.starts)[:, None] + torch.arange(t)[None, :]
    return {"q": q.to(c.dtype), "k": kc.to(c.dtype), "v": vc.to(c.dtype), "rows": gather, "q_pos": q_pos,
            "ctx_end": torch.tensor(ends)}


def reference(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The CPU path: gather the context, masked SDPA, in float32."""
    mask = position_mask(x["q_pos"], x["ctx_end"], x["rows"].shape[1])
    return masked_attention(x["q"].float(), x["k"][x["rows"]].float(), x["v"][x["rows"]].float(), mask)


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    """Every kernel output the tests compare (run with TRITON_INTERPRET=1)."""
    out = {}
    for name in CASES:
        x = case_inputs(name)
        out[name] = padded_prefill_attention(x["q"], x["k"], x["v"], x["rows"], x["q_pos"], x["ctx_end"],
                                            blocks=(16, 16))
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, torch.Tensor]:
    return interpreted_outputs("test_prefill_interpreted")


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_kernel_matches_the_gathered_reference(interpreted: dict[str, torch.Tensor], name: str) -> None:
    x, c = case_inputs(name), CASES[name]
    y, ref = interpreted[name], reference(case_inputs(name))
    assert y.shape == x["q"].shape and y.dtype == c.dtype and torch.isfinite(y).all()  # padding too
    tol = 1e-5 if c.dtype == torch.float32 else 2e-3
    for b, n in enumerate(c.lens):  # the valid queries of each row
        assert (y[b, :n].float() - ref[b, :n]).abs().max().item() < tol, (name, b)


def test_two_chunks_together_are_the_whole_prompt(interpreted: dict[str, torch.Tensor]) -> None:
    whole = case_inputs("two-chunks-2")
    whole = {**whole, "q_pos": torch.arange(50)[None], "q": torch.cat(
        [case_inputs("two-chunks-1")["q"], whole["q"]], dim=1)}
    joined = torch.cat([interpreted["two-chunks-1"], interpreted["two-chunks-2"]], dim=1)
    assert (joined - reference(whole)).abs().max().item() < 1e-5


def test_inputs_it_cannot_serve_are_refused_with_the_fix() -> None:
    pytest.importorskip("triton")
    from infer.models.kernels.prefill_attention import check_caches
    x = case_inputs("prefix-hit")
    q = x["q"].reshape(-1, *x["q"].shape[2:])  # [N, Hq, D]
    check_caches(q, x["k"], x["v"])
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        check_caches(q[:, :3], x["k"], x["v"])
    with pytest.raises(ValueError, match="gather \\+ SDPA"):
        check_caches(torch.zeros(30, 4, 320), torch.zeros(8, 2, 320), torch.zeros(8, 2, 320))
    with pytest.raises(ValueError, match="q \\[N, Hq, D\\]"):
        check_caches(x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match="contiguous"):
        check_caches(q, x["k"].transpose(0, 2).contiguous().transpose(0, 2), x["v"])


def test_the_view_keeps_gather_and_sdpa_off_cuda() -> None:
    from infer.models.kernels.routes import kernels_serve
    assert not kernels_serve(torch.zeros(300, 4, 64))  # a CPU tensor
