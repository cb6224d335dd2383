"""infer.transfer: host <-> device copies (CPU here; tests/gpu checks CUDA)."""

from __future__ import annotations

import torch

from infer.transfer import HostCopy, tensor_on, to_device


def test_to_device_keeps_a_tensor_already_there():
    t = torch.arange(4)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("cpu")) is t


def test_tensor_on_builds_the_values_with_the_dtype():
    t = tensor_on([1, 2, 3], "cpu", torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0, 3.0]
    assert tensor_on([True, False], "cpu").dtype == torch.bool


def test_host_copy_reads_a_cpu_tensor_as_is_or_through_the_buffer_given():
    t = torch.tensor([[3, 4], [5, 6]])
    plain = HostCopy(t)
    assert plain.event is None and plain.host is t and plain.tolist() == [[3, 4], [5, 6]]
    out = torch.zeros(8, dtype=torch.long)
    kept = HostCopy(t, out)
    t.fill_(0)  # the buffer holds the values of the copy, not the tensor's later ones
    assert kept.tolist() == [[3, 4], [5, 6]] and kept.host.data_ptr() == out.data_ptr()
