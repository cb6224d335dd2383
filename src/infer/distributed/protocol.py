"""The messages the driver (rank 0) sends its worker ranks.

Each `Message` carries the KV-pool operations the driver made since the previous one (the
workers repeat them on their pools, so their slots, block tables and prefix caches stay
the driver's; every op carries the driver's result, which the worker checks) and one call:

  MakePool / MakeForward    build a pool / forward function for a model role, as the
                            driver just did (the runners' start-up, mirrored), from the
                            driver's `ForwardSpec`
  Invoke                    run a method of a forward function: the forward part of the
                            driver's call (`run`: a step's flat batch; the proposers'
                            `__call__`, `tree`, `draft_loop`) or a capture
                            ahead of use (`prepare_draft_loops`, `prepare_trees`)
  Report                    every worker answers with its pools' leak reports
  Shutdown                  free everything, leave the process group, exit

A step costs one message: the target's flat batch plan (`run`: numpy arrays of its rows'
tokens, positions and slots) and the ids still on the device after a step that left its
tokens there; the proposers' padded calls carry their ids (CPU [B, T], or on the device),
the BatchLayout, a tree chunk for tree steps, and for a draft model's round the
temperatures, greedy flags and uniforms (every rank samples the tokens it feeds its next
step); CPU tensors travel inside the message (channel.py). Sampling, verification and tree
verification go to the workers as their forward: only rank 0 samples, accepts or rejects, so the
workers need no temperatures, draft tokens or draft probabilities for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.engine.config import EngineConfig
from infer.engine.executor.spec import ForwardSpec

ROLES = ("target", "draft")
POOL_OPS = ("allocate_slot", "free_slot", "truncate_to", "ensure_capacity", "register_prefix", "commit",
            "move_rows")
# the ForwardFn methods a worker runs: the forward part of each call (mirror.py says which)
INVOKABLE = ("run", "__call__", "tree", "draft_loop", "prepare_draft_loops", "prepare_trees")


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
    pass


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Call = MakePool | MakeForward | Invoke | Report | Shutdown


@dataclass(frozen=True, slots=True)
class Message:
    ops: tuple[PoolOp, ...]
    call: Call


@dataclass(frozen=True, slots=True)
class WorkerReport:
    rank: int
    problems: list[str]  # leak reports of the worker's pools
    captures: dict[str, int]  # CUDA graphs its forward functions captured, by kind (`capture_counts`)
