"""How a linear layer's matrix is split over tensor-parallel ranks, and how its output is completed.

A `Parallel` setting is an attribute of a layer (models/linear.py), not a class of its own:

    replicated   the whole matrix on every rank (one process; the embedding's tied head)
    column       a block of output rows (q/k/v, gate/up: the rank's heads or intermediate
                 part); the output needs no communication
    row          a block of input columns (o_proj, down_proj): the local matmul is a partial
                 sum, completed by one all-reduce; the residual add comes after it
    vocab        a block of the vocabulary's rows (lm_head): the ranks' logits are
                 all-gathered so every rank has all of them

Collectives run on torch.distributed's default process group (NCCL on GPUs, where CUDA
graphs capture them like any kernel; gloo on CPUs). A process's tensor-parallel group may
install a faster all-reduce for the messages it serves (`set_small_all_reduce`: the one-shot
kernel of distributed/one_shot.py); every other message goes through the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

PARALLEL_KINDS = ("replicated", "column", "row", "vocab")

# torch 2.13 renamed all_gather_into_tensor (deprecated since) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class Parallel:
    """Which part of the whole matrix a layer holds: `kind` (see the module docstring) over
    `world_size` ranks, this layer's rank being `rank`."""

    kind: str = "replicated"
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PARALLEL_KINDS:
            raise ValueError(f"parallel kind must be one of {list(PARALLEL_KINDS)}, got {self.kind!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")
        if self.kind == "replicated" and self.world_size != 1:
            raise ValueError("a replicated layer is described with world_size 1 (each rank holds all of it)")

    @property
    def partial_output(self) -> bool:
        """Whether the local matmul is a partial sum that `combine` completes (row-parallel):
        a residual add must then come after `combine`, not inside the matmul's epilogue."""
        return self.kind == "row"

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from its local matmul's y [..., local out]."""
        if self.kind == "row":
            return all_reduce_sum(y)
        if self.kind == "vocab":
            return all_gather_columns(y, self.world_size)
        return y


REPLICATED = Parallel()


# y -> the sum over the ranks (a new tensor), or None for a message it does not serve
SmallAllReduce = Callable[[torch.Tensor], torch.Tensor | None]
_small_all_reduce: SmallAllReduce | None = None


def set_small_all_reduce(fn: SmallAllReduce | None) -> None:
    """Install (None: remove) the all-reduce tried first by `all_reduce_sum`: one per process,
    as the process group it runs over (distributed/group.py installs it on joining)."""
    global _small_all_reduce
    _small_all_reduce = fn


def all_reduce_sum(y: torch.Tensor) -> torch.Tensor:
    """Sum y over the ranks (every rank gets the same bits); returns the sum: y itself, summed
    in place by the process group, or a new tensor from the installed small all-reduce."""
    if _small_all_reduce is not None:
        out = _small_all_reduce(y)
        if out is not None:
            return out
    dist.all_reduce(y)
    return y


def all_reduce_max(y: torch.Tensor) -> torch.Tensor:
    """Elementwise max of y over the ranks, in place; returns y."""
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return y


def all_gather_columns(y: torch.Tensor, world_size: int) -> torch.Tensor:
    """[..., n] on each rank -> [..., world_size * n]: rank r's columns at r*n..(r+1)*n-1."""
    rows = y.reshape(-1, y.shape[-1]).contiguous()  # [M, n]
    m, n = rows.shape
    out = torch.empty((world_size * m, n), dtype=y.dtype, device=y.device)
    _all_gather_single(out, rows)  # [N * M, n]: rank r's rows at r*M..
    return out.view(world_size, m, n).permute(1, 0, 2).reshape(*y.shape[:-1], world_size * n)
