"""ForwardFn: the forward interface that the runner and the draft-model proposer call.

A forward function runs one model through its KV pool for one flat batch of rows
(`cache.forward_batch`). The engine's executor provides it: eagerly or replaying CUDA
graphs of the same pass (`engine/executor/batch_forward.py`), or on every rank under
tensor parallelism (`distributed/tp_executor.py`). Sampling and acceptance run on its logits,
above it. It is declared here, below the engine, because the draft-model proposer drives one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds


class ForwardFn(Protocol):
    """The one forward pass of a model through its pool."""

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        """A step's rows laid out (`cache.forward_batch.plan_batch`) -> logits [M, V] of the
        tokens the rows ask for; the pool's lengths set to the rows' ends. `device_ids`: ids
        already on the device (a step's draws) that replace the plan's at their positions."""
        ...
