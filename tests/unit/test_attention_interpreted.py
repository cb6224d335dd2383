"""The split-KV attention kernel (models/kernels/split_attention.py) under Triton's interpreter on the
CPU (tiny shapes; skipped without triton), over padded cases laid out flat
(helpers/padded_attention.py), against the gathered masked-SDPA reference: over four context
chunks that the last program to finish combines (its arrival counters left at zero), or in
one chunk a program as a large batch runs it; a plain verification chunk, and tree
verification with the block rule of a static tree ([T, W]) and of a per-row rule ([B, T, W],
dynamic trees), the block starting one row before the chunk (its root already in the
cache). The interpreter must be on before triton.language is imported, so the kernel runs in
a subprocess.
"""

from __future__ import annotations


import pytest
import torch

from helpers.interpreted import interpreted_outputs
from helpers.padded_attention import padded_split_attention, rule_bits
from infer.models.kernels.arrivals import ArrivalCounters
from infer.models.layers.attention import masked_attention, position_mask

B, T, HQ, HKV, D, S, ROWS = 2, 4, 4, 2, 16, 200, 256  # S = 200: 4 context chunks of 64
FIRST_ROW, WIDTH = 1, 5  # block rows: the root (cached) and the chunk's 4 nodes
# a tree of 4 nodes under the root: nodes 1, 2 children of the root, 3 of 1, 4 of 2
STATIC = torch.tensor([[1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
# row 1: a chain 1 -> 2 -> 3 -> 4
CHAIN = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)


def _case() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(ROWS, HKV, D, generator=g)
    v_cache = torch.randn(ROWS, HKV, D, generator=g)
    q = torch.randn(B, T, HQ, D, generator=g)
    gather = torch.stack([torch.randperm(ROWS - 1, generator=g)[:S] for _ in range(B)])  # [B, S] paged rows
    starts = torch.tensor([150, 70])  # each row's first chunk position (row 1: chunks 3-4 empty)
    q_pos = starts[:, None] + torch.arange(T)  # [B, T]
    return {"k": k_cache, "v": v_cache, "q": q, "gather": gather, "q_pos": q_pos, "ctx_end": starts + T}


def _rules() -> dict[str, torch.Tensor | None]:
    return {"plain": None, "static": STATIC, "per-row": torch.stack([STATIC, CHAIN])}


def run_interpreted_cases() -> dict[str, torch.Tensor]:
    from infer.models.kernels.split_attention import split_plan
    c, out = _case(), {}
    arrivals = ArrivalCounters("cpu")  # one set for every launch, as a pool's passes share theirs
    for name, rows in _rules().items():
        block = None if rows is None else (rows, FIRST_ROW, WIDTH)
        out[name] = padded_split_attention(c["q"], c["k"], c["v"], c["gather"], c["q_pos"], c["ctx_end"], block,
                                           arrivals)
    out["splits"] = torch.tensor(split_plan(S, B * HKV * T)[1])
    out["counters"] = arrivals.take(B * T * HKV).clone()  # the same set, left at zero for the next launch
    import infer.models.kernels.split_attention as kernel
    kernel.TARGET_PROGRAMS = B * HKV * T  # as a large batch: its programs fill the launch, one chunk each
    out["one chunk"] = padded_split_attention(c["q"], c["k"], c["v"], c["gather"], c["q_pos"], c["ctx_end"])
    out["one chunk splits"] = torch.tensor(split_plan(S, B * HKV * T)[1])
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, torch.Tensor]:
    return interpreted_outputs("test_attention_interpreted")


@pytest.mark.parametrize("rule", list(_rules()))
def test_the_kernel_is_the_gathered_masked_attention(interpreted: dict[str, torch.Tensor], rule: str) -> None:
    c, rows = _case(), _rules()[rule]
    mask = position_mask(c["q_pos"], c["ctx_end"], S)  # [B, T, S]
    if rows is not None:
        mask = mask & _block_visibility(rows, c["q_pos"])
    ref = masked_attention(c["q"], c["k"][c["gather"]], c["v"][c["gather"]], mask)
    assert torch.allclose(interpreted[rule], ref, atol=1e-5, rtol=1e-5)
    if rows is not None:  # the rule changed the result (a kernel ignoring it fails above)
        plain = masked_attention(c["q"], c["k"][c["gather"]], c["v"][c["gather"]],
                                 position_mask(c["q_pos"], c["ctx_end"], S))
        assert not torch.allclose(ref, plain, atol=1e-3)


def test_the_chunks_are_combined_by_the_last_arrival(interpreted: dict[str, torch.Tensor]) -> None:
    assert interpreted["splits"].item() == 4  # (the cases above combine four chunks, two empty in row 1)
    assert not interpreted["counters"].any()


def test_a_launch_whose_programs_fill_the_gpu_reads_each_context_in_one_chunk(
        interpreted: dict[str, torch.Tensor]) -> None:
    c = _case()
    ref = masked_attention(c["q"], c["k"][c["gather"]], c["v"][c["gather"]],
                           position_mask(c["q_pos"], c["ctx_end"], S))
    assert interpreted["one chunk splits"].item() == 1  # (the direct store, no partials to combine)
    assert torch.allclose(interpreted["one chunk"], ref, atol=1e-5, rtol=1e-5)


def test_the_split_plan_gives_large_batches_fewer_chunks() -> None:
    from infer.models.kernels.split_attention import MAX_SPLITS, MIN_CHUNK, TARGET_PROGRAMS, split_plan
    assert split_plan(4096, 8) == (4096 // MAX_SPLITS, MAX_SPLITS)  # batch 1, 8 KV heads: the most chunks
    assert split_plan(200, 8) == (MIN_CHUNK, 4)  # never shorter than MIN_CHUNK
    chunks = [split_plan(4096, 8 * b)[1] for b in (1, 16, 32, 64, 128, 256)]
    assert chunks == sorted(chunks, reverse=True) and chunks[-1] == 1
    assert split_plan(1000, TARGET_PROGRAMS) == (1024, 1)  # one chunk covers the whole width


def test_rule_bits_pack_the_rule() -> None:
    assert rule_bits(STATIC).tolist() == [0b00011, 0b00101, 0b01011, 0b10101]
    assert rule_bits(torch.stack([STATIC, CHAIN])).shape == (2, T)


def _block_visibility(rows: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """[B, T, S]: inside each row's block (from q_pos[:, 0] - FIRST_ROW, WIDTH wide) only the
    keys the rule sets; every key outside it."""
    base = q_pos[:, :1] - FIRST_ROW  # [B, 1]
    rel = torch.arange(S)[None, :] - base  # [B, S]
    inside = (rel >= 0) & (rel < WIDTH)
    allowed = rows.expand(B, T, WIDTH).gather(2, rel.clamp(0, WIDTH - 1)[:, None, :].expand(B, T, S))
    return allowed | ~inside[:, None, :]
