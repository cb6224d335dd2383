"""The staging helpers of engine/executor/staging.py, on the CPU (the graphs themselves are
tested on the GPU in tests/gpu)."""

from __future__ import annotations

import torch

from infer.engine.executor.staging import _capture_inputs, _host_indices, _loop_segments, _split, _stage_sampling


class _Ring:
    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    def next_host(self) -> torch.Tensor:
        return self.host


def test_sampling_staging_rows_are_temperature_greedy_then_uniforms_per_step():
    host = torch.full((2 + 3, 4), -1.0, dtype=torch.float64)  # [2 + U, bucket]
    uniforms = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=torch.float64)  # [n, U]
    _stage_sampling(_Ring(host), 2, [0.7, 1.0], [False, True], uniforms)
    assert host[:, :2].tolist() == [[0.7, 1.0], [0.0, 1.0], [0.1, 0.4], [0.2, 0.5], [0.3, 0.6]]
    assert (host[:, 2:] == -1).all()  # padding rows untouched


def test_capture_inputs_point_every_row_at_the_scratch_row():
    segments = _loop_segments(2, 3, 4, 16)  # bucket 2, first width 3, 4 steps: union width 6
    parts = _split(torch.full((1000,), -1, dtype=torch.long), 2, 3, 16, segments)
    _capture_inputs(parts, 6, 99)
    assert parts["positions"].tolist() == [list(range(6))] * 2
    assert (parts["write_rows"] == 99).all() and (parts["gather_rows"] == 99).all()
    assert parts["ctx_end"].tolist() == [6, 6] and (parts["ids"] == -1).all()
    indices = _host_indices(parts)
    assert indices.q_pos is parts["positions"] and indices.write_rows is parts["write_rows"]
    assert indices.gather_rows is parts["gather_rows"] and indices.ctx_end is parts["ctx_end"]


def test_tree_verifier_reads_what_its_staging_writes():
    # the tree verifier graph's computation on the CPU, from staged buffers of a bucket of 4
    # holding 3 rows: the same rows as the eager verifier
    from infer.engine.executor.forward import verify_on_tree_logits
    from infer.engine.executor.tree_graphs import stage_nodes, verify_staged
    from infer.speculative.tree import TreeShape
    shape, n, bucket = TreeShape((2, 2)), 3, 4
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bucket, 7, 5, generator=gen)
    tokens = torch.randint(0, 5, (n, 6), generator=gen)
    valid = torch.tensor([[True] * 6, [True, True, False, False, True, False], [False] * 6])
    uniforms = torch.rand(n, shape.num_uniforms, generator=gen, dtype=torch.float64)
    temps, greedy = [0.7, 1.0, 1.3], [False, True, False]
    q = torch.softmax(torch.randn(bucket, 6, 5, generator=gen), dim=-1)
    longs = torch.full((2 * bucket * 6,), -1, dtype=torch.long)
    floats = torch.full((2 + shape.num_uniforms, bucket), 0.5, dtype=torch.float64)
    stage_nodes(longs, bucket, tokens, valid)
    _stage_sampling(_Ring(floats), n, temps, greedy, uniforms)
    for mode, probs, rows_greedy in (("one_hot", None, greedy), ("draft_probs", q, greedy),
                                     ("greedy", None, [True] * n)):
        if mode == "greedy":
            _stage_sampling(_Ring(floats), n, [1.0] * n, rows_greedy, uniforms)
        got = verify_staged(shape, mode, logits, longs, floats, probs)[:n]
        want = verify_on_tree_logits(shape, logits[:n], tokens, valid, None if probs is None else probs[:n],
                                     temps if mode != "greedy" else [1.0] * n, rows_greedy, uniforms)
        assert got.tolist() == want.tolist()
    assert got.shape == (n, 2 * 2 + 2)
