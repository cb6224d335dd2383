"""ForwardFn: one model's forward through its KV pool for a flat batch of rows, as the engine's
executor provides it (eager, CUDA graphs or tensor parallel); declared below the engine."""

from __future__ import annotations

from typing import Protocol

import torch

from infer.cache.forward_batch import BatchPlan, DeviceIds


class ForwardFn(Protocol):
    """The one forward pass of a model through its pool."""

    def run(self, plan: BatchPlan, device_ids: DeviceIds | None = None) -> torch.Tensor:
        """A step's rows laid out (`plan_batch`) -> logits [M, V] of the tokens the rows ask for; the
        pool's lengths set to the rows' ends. `device_ids`: ids on the device replacing the plan's."""
        ...
