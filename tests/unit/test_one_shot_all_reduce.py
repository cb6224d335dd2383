"""The one-shot all-reduce's wiring, on the CPU (the kernel itself runs on two GPUs:
tests/gpu/test_gpu_one_shot.py): the setting is refused where it cannot run, before any
process group or model; a group's `Collectives.all_reduce_sum` takes its small all-reduce's
sum and sends every message it declines through the process group; `leave` closes it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import infer.models.layers.parallel as parallel
from infer.distributed.group import join, leave
from infer.distributed.one_shot import OneShotAllReduce, serves
from infer.engine.config import EngineConfig


def test_the_setting_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_all_reduce must be one of"):
        EngineConfig(tensor_parallel_all_reduce="two-shot")
    for fields in (dict(tensor_parallel_size=1), dict(tensor_parallel_size=2, device="cpu")):
        with pytest.raises(ValueError, match="tensor_parallel_all_reduce='one-shot' runs between CUDA devices"):
            EngineConfig(tensor_parallel_all_reduce="one-shot", **fields)
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_all_reduce == "nccl"
    # a CPU rank asked for it fails before joining any group
    with pytest.raises(ValueError, match="not cpu: set tensor_parallel_all_reduce='nccl'"):
        join(0, 2, torch.device("cpu"), None, "one-shot")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not cpu"):
        OneShotAllReduce(torch.device("cpu"))


def test_all_reduce_sum_takes_the_small_all_reduce_first(monkeypatch: pytest.MonkeyPatch) -> None:
    through_group: list[torch.Tensor] = []
    monkeypatch.setattr(parallel.dist, "all_reduce", lambda y: through_group.append(y))
    seen: list[int] = []

    def small(y: torch.Tensor) -> torch.Tensor | None:  # serves messages of at most 4 values
        seen.append(y.numel())
        return y * 2 if y.numel() <= 4 else None

    collectives = parallel.Collectives(small)
    x = torch.arange(4.0)
    assert torch.equal(collectives.all_reduce_sum(x), torch.arange(4.0) * 2) and through_group == []
    big = torch.arange(6.0)
    assert collectives.all_reduce_sum(big) is big and through_group == [big]  # declined: the group's
    assert seen == [4, 6]
    # a row-parallel layer's combine goes through its setting's collectives; the default's has none
    y = torch.ones(2, 2)
    assert torch.equal(parallel.Parallel("row", 0, 2, collectives).combine(y), torch.full((2, 2), 2.0))
    assert parallel.Parallel("row", 0, 2).combine(y) is y and through_group[-1] is y
    leave(collectives)  # (no group joined: closes it only)
    assert collectives.small is None
    x = torch.ones(3)
    assert collectives.all_reduce_sum(x) is x and through_group[-1] is x and seen == [4, 6, 4]


def test_cpu_tensors_are_not_served() -> None:
    assert not serves(torch.ones(8))
    assert not serves(torch.ones(8, dtype=torch.float16))
