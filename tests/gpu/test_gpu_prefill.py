"""The flash prefill kernel (models/kernels/prefill_attention.py) on the GPU, at realistic sizes (run on
the GPU machine: `pytest -m gpu tests/gpu/test_gpu_prefill.py`).

- One prompt of 2,500 tokens whose first 500 are cached (a prefix-cache hit), prefilled in two
  chunks of 1,000 (a chunk boundary), 24 query heads on 8 KV heads, head_dim 128, KV in pages
  of 16 rows in shuffled order: each chunk matches the gathered masked-SDPA reference computed
  in float32 from the same bf16 inputs, within twice the error of the bf16 gather + SDPA path
  itself (plus bf16's last place), and exactly so in float32 to 1e-4.
- A batch of a 1,000-token chunk after a 500-token prefix beside a 700-token prompt (right
  padded), and head_dim 96 (padded to 128 inside): the same bound on the valid queries.
- The flat batch's view (`BatchView`) routes a long chunk on CUDA to the kernel, and its
  output is the forced gather + SDPA path's, within the same bound.
"""

from __future__ import annotations

import pytest
import torch

from helpers.padded_attention import padded_prefill_attention
from infer.models.kernels.arrivals import ArrivalCounters
from infer.models.layers.attention import masked_attention, position_mask

pytestmark = pytest.mark.gpu

PAGE = 16


def _inputs(starts: list[int], lens: list[int], hq: int = 24, hkv: int = 8, d: int = 128,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """q [B, T, Hq, D]; caches [rows, Hkv, D] holding each row's whole context in shuffled
    pages; gather_rows [B, S]; q_pos [B, T]; ctx_end [B]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ends = [s + n for s, n in zip(starts, lens, strict=True)]
    batch, t, s = len(starts), max(lens), max(ends) + 64
    pages = sum(-(-e // PAGE) for e in ends) + 8
    scratch = pages * PAGE
    kc = torch.randn(scratch + 1, hkv, d, device="cuda", generator=gen).to(dtype)
    vc = torch.randn(scratch + 1, hkv, d, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(pages, device="cuda", generator=gen)
    gather = torch.full((batch, s), scratch, dtype=torch.long, device="cuda")
    used = 0
    for b, end in enumerate(ends):
        n_pages = -(-end // PAGE)
        rows = (order[used:used + n_pages, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(-1)
        gather[b, :end] = rows[:end]
        used += n_pages
    q = torch.randn(batch, t, hq, d, device="cuda", generator=gen).to(dtype)
    q_pos = torch.tensor(starts, device="cuda")[:, None] + torch.arange(t, device="cuda")[None, :]
    return {"q": q, "k": kc, "v": vc, "rows": gather, "q_pos": q_pos,
            "ctx_end": torch.tensor(ends, device="cuda")}


def _reference(x: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    mask = position_mask(x["q_pos"], x["ctx_end"], x["rows"].shape[1])
    return masked_attention(x["q"].to(dtype), x["k"][x["rows"]].to(dtype), x["v"][x["rows"]].to(dtype), mask)


def _kernel(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return padded_prefill_attention(x["q"], x["k"], x["v"], x["rows"], x["q_pos"], x["ctx_end"])


def _check(y: torch.Tensor, x: dict[str, torch.Tensor], lens: list[int]) -> None:
    exact, sdpa = _reference(x), _reference(x, x["q"].dtype)
    assert y.dtype == x["q"].dtype and torch.isfinite(y).all()
    for b, n in enumerate(lens):
        ours = (y[b, :n].float() - exact[b, :n]).abs().max().item()
        theirs = (sdpa[b, :n].float() - exact[b, :n]).abs().max().item()
        assert ours <= 2 * theirs + 4e-3, (b, ours, theirs)


def test_two_chunks_after_a_prefix_hit_match_the_reference() -> None:
    whole = _inputs([500], [2000], seed=7)  # the prompt's 2,500 tokens in the cache, 500 of them a prefix
    for c in range(2):  # chunk 1 after the cached prefix, chunk 2 after chunk 1
        cols = slice(1000 * c, 1000 * (c + 1))
        x = {**whole, "q": whole["q"][:, cols], "q_pos": whole["q_pos"][:, cols],
             "ctx_end": whole["ctx_end"] - 1000 * (1 - c)}
        _check(_kernel(x), x, [1000])


def test_float32_is_exact() -> None:
    x = _inputs([500], [1000], dtype=torch.float32)
    assert (_kernel(x) - _reference(x)).abs().max().item() < 1e-4


@pytest.mark.parametrize("d", [128, 96])
def test_a_padded_batch_and_a_head_size_off_the_powers_of_two(d: int) -> None:
    x = _inputs([500, 0], [1000, 700], d=d, seed=d)
    _check(_kernel(x), x, [1000, 700])


def test_the_view_routes_long_chunks_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.models.kernels.prefill_attention as prefill
    import infer.models.kernels.routes as routes
    import infer.models.layers.paged_attention as paged
    from infer.cache.forward_batch import Row, build_batch, plan_batch
    from infer.cache.block_tables import BlockTables
    x = _inputs([500], [1000], seed=3)
    rows = x["rows"][0].tolist()  # the storage row of each context position: one-position blocks
    tables = BlockTables(1, len(rows), "cuda")
    tables.set(0, 0, rows)
    batch = build_batch(plan_batch([Row(0, 500, [0] * 1000)]), tables, 1, x["k"].shape[0] - 1, "cuda")
    q = x["q"][0]  # [T, Hq, D]
    calls = []
    kernel = prefill.prefill_attention
    monkeypatch.setattr(prefill, "prefill_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    arrivals = ArrivalCounters("cuda")
    routed = paged.BatchView(x["k"][None], x["v"][None], batch, arrivals).attend_written(q, x["k"], x["v"])[None]
    assert calls == [1]
    monkeypatch.setattr(routes, "kernels_serve", lambda q: False)
    gathered = paged.BatchView(x["k"][None], x["v"][None], batch, arrivals).attend_written(q, x["k"], x["v"])[None]
    assert calls == [1]
    exact = _reference(x)
    ours, theirs = ((y.float() - exact).abs().max().item() for y in (routed, gathered))
    assert ours <= 2 * theirs + 4e-3
