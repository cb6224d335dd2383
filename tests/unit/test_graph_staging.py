"""The staging helpers of engine/executor/staging.py, on the CPU (the graphs themselves are
tested on the GPU in tests/gpu)."""

from __future__ import annotations

import torch

from infer.engine.executor.staging import _capture_inputs, _host_indices, _split, _stage_sampling


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
    # bucket 2, first width 3, 4 steps: union width 6 (a head round's segments)
    segments = [("ids", (2, 3)), ("positions", (2, 6)), ("write_rows", (12,)), ("gather_rows", (2, 16)),
                ("ctx_end", (2,))]
    parts = _split(torch.full((1000,), -1, dtype=torch.long), segments)
    _capture_inputs(parts, 6, 99)
    assert parts["positions"].tolist() == [list(range(6))] * 2
    assert (parts["write_rows"] == 99).all() and (parts["gather_rows"] == 99).all()
    assert parts["ctx_end"].tolist() == [6, 6] and (parts["ids"] == -1).all()
    indices = _host_indices(parts)
    assert indices.q_pos is parts["positions"] and indices.write_rows is parts["write_rows"]
    assert indices.gather_rows is parts["gather_rows"] and indices.ctx_end is parts["ctx_end"]
