"""The messages the driver (rank 0) sends its worker ranks.

Each `Message` carries the split pools' KV changes since the previous one (`PoolChanges`),
then one call: `MakePool`, `MakeForward`, `Invoke`, `Report` or `Shutdown`. A step costs one
message. docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.parts import ExecutionConfig
from infer.engine.executor.spec import ForwardSpec

ROLES = ("target", "draft")
INVOKABLE = ("run",)  # the ForwardFn methods a worker runs

RowMove = tuple[tuple[int, ...], tuple[int, ...]]  # (source rows, destination rows) of a `move_rows`


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"model role must be one of {ROLES}, got {role!r}")


@dataclass(frozen=True, slots=True)
class PoolShape:
    """How the driver's pool lays out its KV; a worker's pool takes the same rows, blocks and tables."""

    rows: int  # storage rows, the scratch row last
    block_size: int
    max_batch_size: int  # slots: rows of the block tables
    max_blocks: int  # entries of a slot's block table
    max_seq_len: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.rows, self.block_size, self.max_batch_size, self.max_blocks, self.max_seq_len) < 1:
            raise ValueError(f"a pool's sizes are >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class PoolChanges:
    """A split pool's KV changes since the last message, made by the workers before the call:
    block-table entries set and rows moved, each in order."""

    pool: int
    tables: np.ndarray  # [K, 3]
    moves: tuple[RowMove, ...]


@dataclass(frozen=True, slots=True)
class MakePool:
    pool: int
    role: str  # "target" | "draft"
    shape: PoolShape
    tables: np.ndarray  # [K, 3] (slot, index, block): the driver's table entries set so far

    def __post_init__(self) -> None:
        _check_role(self.role)


@dataclass(frozen=True, slots=True)
class MakeForward:
    forward: int
    role: str
    pool: int
    execution: ExecutionConfig  # (the kernel bundle is rebuilt from it: `kernels` names the driver's)
    spec: ForwardSpec  # the driver's, with the eager kernels in it (compiled kernels do not travel)
    kernels: str  # "eager" | "fused"

    def __post_init__(self) -> None:
        _check_role(self.role)
        if self.kernels not in ("eager", "fused"):
            raise ValueError(f"kernels must be 'eager' or 'fused', got {self.kernels!r}")


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call `method` of the worker's forward function `target` with `args` (its result is dropped)."""

    target: int
    method: str  # one of INVOKABLE
    args: tuple[object, ...]

    def __post_init__(self) -> None:
        if self.method not in INVOKABLE:
            raise ValueError(f"a worker's forward function runs one of {INVOKABLE}, not {self.method!r}")


@dataclass(frozen=True, slots=True)
class Report:
    tables: dict[int, str]  # pool id -> digest of the driver's block tables (a worker's must match)


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Call = MakePool | MakeForward | Invoke | Report | Shutdown


@dataclass(frozen=True, slots=True)
class Message:
    changes: tuple[PoolChanges, ...]
    call: Call


@dataclass(frozen=True, slots=True)
class WorkerReport:
    rank: int
    problems: list[str]  # where the worker's pools differ from the driver's
    captures: dict[str, int]  # CUDA graphs its forward functions captured, by kind (`capture_counts`)
