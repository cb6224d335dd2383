"""The messages the driver (rank 0) sends its worker ranks.

Each `Message` carries the KV-pool operations the driver made since the previous one (the
workers repeat them on their pools, so their slots, block tables and prefix caches stay
the driver's; every op carries the driver's result, which the worker checks) and one call:

  MakePool / MakeForward    build a pool / forward function for a model role, as the
                            driver just did (the runners' start-up, mirrored)
  Forward / Sample /        one call of a forward function (ForwardFn), with the same
  DraftLoop / PrepareDraftLoops  arguments the driver's call got
  Report                    every worker answers with its pools' leak reports
  Shutdown                  free everything, leave the process group, exit

A step costs one message: ids (CPU [B, T]), the BatchLayout (slots, start positions, chunk
lengths, width), and for sampling calls the temperatures, greedy flags and uniforms; CPU
tensors travel inside the message (channel.py). Verification goes to the workers as a plain
`Forward` with all logits: only rank 0 accepts or rejects, so the workers need no draft
probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.cache.view import BatchLayout
from infer.engine.config import EngineConfig

ROLES = ("target", "draft")
POOL_OPS = ("allocate_slot", "free_slot", "truncate_to", "ensure_capacity", "register_prefix", "commit")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"model role must be one of {ROLES}, got {role!r}")


@dataclass(frozen=True, slots=True)
class PoolOp:
    pool: int
    name: str  # one of POOL_OPS
    args: tuple[object, ...]
    # what the driver's pool returned (allocate_slot: with the slot's cached length): a worker's must match
    result: object

    def __post_init__(self) -> None:
        if self.name not in POOL_OPS:
            raise ValueError(f"pool operation must be one of {POOL_OPS}, got {self.name!r}")


@dataclass(frozen=True, slots=True)
class MakePool:
    pool: int
    role: str  # "target" | "draft"
    config: EngineConfig
    prefix_caching: bool

    def __post_init__(self) -> None:
        _check_role(self.role)


@dataclass(frozen=True, slots=True)
class MakeForward:
    forward: int
    role: str
    pool: int
    config: EngineConfig  # (the kernel bundle is rebuilt from it: `kernels` names the driver's)
    use_cuda_graphs: bool
    max_batch_size: int
    shapes: tuple[tuple[int, bool], ...]
    kernels: str  # "eager" | "fused"
    sample_widths: tuple[int, ...]
    small_batch_shapes: tuple[tuple[int, bool], ...] | None
    verify_modes: tuple[str, ...]
    sampling_batch_max: int | None

    def __post_init__(self) -> None:
        _check_role(self.role)
        if self.kernels not in ("eager", "fused"):
            raise ValueError(f"kernels must be 'eager' or 'fused', got {self.kernels!r}")


@dataclass(frozen=True, slots=True)
class Forward:
    forward: int
    ids: torch.Tensor  # [B, T]
    layout: BatchLayout
    all_logits: bool


@dataclass(frozen=True, slots=True)
class Sample:
    forward: int
    ids: torch.Tensor  # [B, T]
    layout: BatchLayout
    temperatures: tuple[float, ...]
    uniforms: torch.Tensor  # CPU float64 [B]
    greedy: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class DraftLoop:
    forward: int
    ids: torch.Tensor  # [B, w]
    layout: BatchLayout
    steps: int
    temperatures: tuple[float, ...]
    uniforms: torch.Tensor  # CPU float64 [B, steps]
    greedy: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class PrepareDraftLoops:
    forward: int
    widths: tuple[int, ...]
    steps: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Report:
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Call = MakePool | MakeForward | Forward | Sample | DraftLoop | PrepareDraftLoops | Report | Shutdown


@dataclass(frozen=True, slots=True)
class Message:
    ops: tuple[PoolOp, ...]
    call: Call


@dataclass(frozen=True, slots=True)
class WorkerReport:
    rank: int
    problems: list[str]  # leak reports of the worker's pools
