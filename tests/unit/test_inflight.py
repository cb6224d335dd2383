"""InFlight: a step's sampled tokens kept on the device for the next step's input ids."""

from __future__ import annotations

import torch

from infer.engine.inflight import InFlight, TokenBuffers
from infer.engine.request import Request
from infer.sampling import SamplingParams


def _request(i: int, prompt: list[int]) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=8))


def test_input_ids_come_from_the_step_in_flight_or_from_the_host():
    a, b, c = _request(0, [1, 2]), _request(1, [3]), _request(2, [4, 5, 6])
    buffers = TokenBuffers(8, torch.device("cpu"))
    step = InFlight.launch([a, b], torch.tensor([70, 71]), buffers, [None, None])
    assert (a.pending_tokens, b.pending_tokens) == (1, 1)
    same = step.input_ids([a, b])  # the steady state: read in place
    assert same.tolist() == [[70], [71]] and same.data_ptr() == step.tokens.data_ptr()
    assert step.input_ids([a]).tolist() == [[70]]
    # reordered, and a request the step did not sample for (its newest id is on the host)
    assert step.input_ids([b, c, a]).tolist() == [[71], [6], [70]]
    assert step.host_tokens() == [70, 71]
    # the two host buffers are used in turn
    other = InFlight.launch([c], torch.tensor([9]), buffers, [None])
    assert other.host.host.data_ptr() != step.host.host.data_ptr() and other.host_tokens() == [9]
    assert step.host_tokens() == [70, 71]  # (its buffer untouched by the next step's copy)
