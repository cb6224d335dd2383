"""The tensor-parallel process groups: devices per rank, joining, leaving.

Every rank joins the default group (NCCL on GPUs, gloo on CPUs) and a gloo control group for
the driver's messages; rendezvous through a loopback TCP store, or torchrun's environment.
docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from infer.models.layers.parallel import Collectives

CONTROL_TIMEOUT = timedelta(days=3650)  # a worker waits for the next step however long the engine idles
JOIN_TIMEOUT = timedelta(minutes=10)  # the default group's collectives (a step's all-reduces)


@dataclass(frozen=True, slots=True)
class Group:
    """What a rank joined: the control group, and the collectives its model's parallel layers run."""

    control: dist.ProcessGroup
    collectives: Collectives


@dataclass(frozen=True, slots=True)
class TorchrunRank:
    """The rank torchrun gave this process (RANK, LOCAL_RANK, WORLD_SIZE)."""

    rank: int
    local_rank: int
    world_size: int


def torchrun_rank() -> TorchrunRank | None:
    """This process's rank when `torchrun` started it (its variables are set), else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return TorchrunRank(int(env["RANK"]), int(env.get("LOCAL_RANK", "0")), int(env["WORLD_SIZE"]))


def is_torchrun_worker() -> bool:
    """Whether torchrun started this process as a rank above 0 (a worker of rank 0's engine)."""
    launch = torchrun_rank()
    return launch is not None and launch.rank != 0


def plan_devices(device: str, world_size: int, cuda_count: int) -> list[torch.device]:
    """The device of each rank on one machine: "cpu", or consecutive GPUs from "cuda[:k]" ("auto":
    cuda when there is one). ValueError when the machine has fewer GPUs than ranks."""
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    base = torch.device(device)
    if base.type == "cpu":
        return [torch.device("cpu")] * world_size
    if base.type != "cuda":
        raise ValueError(f"tensor parallelism runs on 'cpu' or 'cuda' devices, got {device!r}")
    first = base.index or 0
    if first + world_size > cuda_count:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices (cuda:{first}.."
                         f"cuda:{first + world_size - 1}), but this machine has {cuda_count}: lower "
                         "tensor_parallel_size, or start one process per GPU on several machines with torchrun")
    return [torch.device("cuda", first + r) for r in range(world_size)]


def torchrun_device(device: str, local_rank: int, cuda_count: int) -> torch.device:
    """A torchrun rank's device: GPU `local_rank` of its node, or the CPU."""
    if device == "cpu" or (device == "auto" and cuda_count == 0):
        return torch.device("cpu")
    if local_rank >= cuda_count:
        raise ValueError(f"torchrun local rank {local_rank} has no GPU: this node has {cuda_count}; start at "
                         "most one process per GPU (--nproc-per-node)")
    return torch.device("cuda", local_rank)


LOOPBACK = "lo"  # Linux's loopback interface


@contextmanager
def loopback_gloo() -> Iterator[None]:
    """Gloo groups created inside connect over the loopback interface unless GLOO_SOCKET_IFNAME
    is set (the host name's address is not always reachable in containers)."""
    if sys.platform != "linux" or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(rank: int, world_size: int, device: torch.device, store: dist.Store | None,
         all_reduce: str = "nccl") -> Group:
    """Join the default group (through `store`, or torchrun's env:// when None) and the control
    group, NVLink multicast off unless the environment says otherwise. `all_reduce="one-shot"`
    (CUDA only) gives the collectives the one-shot all-reduce; `leave` closes it."""
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed process group: one tensor-parallel "
                           "engine per process at a time (close the other engine first)")
    backend = backend_for(device)
    if all_reduce not in ("nccl", "one-shot"):
        raise ValueError(f"all_reduce must be 'nccl' or 'one-shot', got {all_reduce!r}")
    if all_reduce == "one-shot" and backend != "nccl":
        raise ValueError(f"tensor_parallel_all_reduce='one-shot' runs between CUDA devices, not {device.type}: "
                         "set tensor_parallel_all_reduce='nccl'")
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=None if store is not None else "env://", store=store, rank=rank,
                            world_size=world_size, timeout=JOIN_TIMEOUT,
                            device_id=device if backend == "nccl" else None)
    collectives = Collectives()
    try:
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        assert control is not None
        dist.all_reduce(torch.zeros(1, device=device))  # connects every rank now, not inside a CUDA graph capture
        if all_reduce == "one-shot":
            from infer.distributed.one_shot import OneShotAllReduce
            collectives.small = OneShotAllReduce(device)
    except BaseException:
        collectives.close()
        dist.destroy_process_group()
        raise
    return Group(control, collectives)


def leave(collectives: Collectives | None = None) -> None:
    """Leave the process groups, closing `collectives` first. Free CUDA graphs that captured
    collectives before: NCCL cannot destroy a communicator a graph still holds."""
    if collectives is not None:
        collectives.close()
    if dist.is_initialized():
        dist.destroy_process_group()
