"""A tensor-parallel worker rank: loads its shard of the model(s), then runs what the driver sends.

Started by the engine (`main(ready_fd)`) with its `WorkerSpec` on stdin, exiting when that pipe
closes; under torchrun `serve_torchrun_rank`. `Worker.run` serves one message at a time; any
error ends the worker. docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from infer.distributed.channel import ControlChannel
from infer.distributed.group import Group, join, leave, torchrun_device
from infer.distributed.protocol import Call, Invoke, MakeForward, MakePool, Message, Report, Shutdown, WorkerReport
from infer.distributed.worker_pool import WorkerPool, table_digest
from infer.engine.config import EngineConfig
from infer.engine.parts import ParallelConfig
from infer.engine.executor import ForwardFn
from infer.engine.executor.factory import LOCAL
from infer.engine.executor.spec import ForwardSpec
from infer.engine.loading import load_draft, load_part, load_target
from infer.engine.executor.kernels import step_kernels
from infer.engine.threads import apply_cpu_threads
from infer.timing import synchronize
from infer.models.kernels.bundle import EAGER
from infer.models.layers.parallel import GROUP, Collectives
from infer.models.layers.shard import ModelShard
from infer.models.llama import LlamaForCausalLM

EXIT_DRIVER_GONE = 3


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    rank: int
    world_size: int
    store_port: int  # the driver's TCP store on 127.0.0.1
    device: str
    config: EngineConfig  # model paths resolved by the driver (local directories or files)

    def __post_init__(self) -> None:
        if not 0 < self.rank < self.world_size or self.world_size != self.config.tensor_parallel_size:
            raise ValueError(f"a worker's rank is 1..{self.config.tensor_parallel_size - 1} of "
                             f"tensor_parallel_size ranks, got rank {self.rank} of {self.world_size}")


def shards_for(parallel: ParallelConfig, rank: int, collectives: Collectives = GROUP
               ) -> tuple[ModelShard, ModelShard | None]:
    """(the target's shard, the draft's: None when the draft runs whole on the driver);
    their layers run `collectives` (the rank's group's)."""
    target = ModelShard(rank, parallel.size, parallel.embedding, parallel.lm_head, collectives)
    return target, target if parallel.draft == "sharded" else None


def load_rank_models(config: EngineConfig, rank: int, device: torch.device,
                     collectives: Collectives = GROUP) -> dict[str, LlamaForCausalLM]:
    """A worker's models by role: its shard of the target, and of the draft when sharded."""
    target_shard, draft_shard = shards_for(config.parallel_part(), rank, collectives)
    load = load_part(config, device)
    models = {"target": load_target(load, target_shard, max_seq_len=config.max_seq_len)}
    if load.draft_model is not None and draft_shard is not None:
        models["draft"] = load_draft(load, models["target"], draft_shard, max_seq_len=config.max_seq_len)
    return models


def table_problems(pools: dict[int, WorkerPool], driver: dict[int, str]) -> list[str]:
    """Where this rank's block tables differ from the driver's (`driver`: its digests by pool)."""
    problems = [f"pool {pid}: block tables differ from the driver's" for pid, pool in pools.items()
                if driver.get(pid) != table_digest(pool.tables)]
    return problems + [f"pool {pid}: missing on this rank" for pid in driver if pid not in pools]


def capture_counts(forwards: Iterable[ForwardFn]) -> dict[str, int]:
    """The CUDA graphs these forward functions captured: plain ones and those with tree rules."""
    counts = dict.fromkeys(("forward", "trees"), 0)
    for forward in forwards:
        graphs = getattr(getattr(forward, "fn", None), "graphs", {})
        counts["forward"] += sum(1 for _, tree in graphs if not tree)
        counts["trees"] += sum(1 for _, tree in graphs if tree)
    return counts


class Worker:
    """A worker rank's state: its models by role, and the pools and forward functions the
    driver had it build, by the driver's ids."""

    def __init__(self, models: dict[str, LlamaForCausalLM], channel: ControlChannel, rank: int) -> None:
        self.models, self.channel, self.rank = models, channel, rank
        self.pools: dict[int, WorkerPool] = {}
        self.forwards: dict[int, ForwardFn] = {}

    @torch.inference_mode()
    def run(self) -> None:
        """Serve messages until Shutdown."""
        while self.serve(self.channel.recv()):
            pass

    def serve(self, message: Message) -> bool:
        """The KV changes the driver made since the last message, then its call; False for Shutdown."""
        for changes in message.changes:
            self.pools[changes.pool].apply(changes)
        return self.handle(message.call)

    def handle(self, call: Call) -> bool:
        """Run one call; False for Shutdown."""
        match call:
            case Invoke():
                # the forward part of the driver's call: its collectives meet rank 0's; the
                # result (this shard's logits, the tokens of a draft round) is rank 0's to use
                getattr(self.forwards[call.target], call.method)(*call.args)
            case MakePool():
                pool = self.pools[call.pool] = WorkerPool(self.models[call.role], call.shape)
                pool.tables.apply(call.tables)
            case MakeForward():
                self.forwards[call.forward] = self._make_forward(call)
            case Report():
                self.channel.gather_reports(WorkerReport(self.rank, table_problems(self.pools, call.tables),
                                                         capture_counts(self.forwards.values())))
            case Shutdown():
                return False
        return True

    def _make_forward(self, call: MakeForward) -> ForwardFn:
        model = self.models[call.role]
        return LOCAL.make_forward(model, self.pools[call.pool], self.worker_spec(call, model))

    def worker_spec(self, call: MakeForward, model: LlamaForCausalLM) -> ForwardSpec:
        """The driver's spec with this rank's kernel bundle."""
        device = next(model.parameters()).device
        kernels = EAGER
        if call.kernels != EAGER.name:
            kernels = step_kernels(call.execution, device, model)
        if kernels.name != call.kernels:
            raise RuntimeError(f"rank {self.rank}: kernel bundle {kernels.name!r}, the driver's {call.kernels!r}")
        return replace(call.spec, kernels=kernels)

    def release(self) -> None:
        """Free the forward functions (their CUDA graphs hold the NCCL communicator), pools
        and models before the process group goes."""
        self.forwards.clear()
        self.pools.clear()
        self.models.clear()
        gc.collect()


def serve_rank(config: EngineConfig, rank: int, device: torch.device, group: Group) -> None:
    """Load this rank's models and serve the driver until it shuts the engine down."""
    models = load_rank_models(config, rank, device, group.collectives)
    apply_cpu_threads(config.threads, device, sum(p.numel() for p in models["target"].parameters()))
    worker = Worker(models, ControlChannel(group.control, rank, device), rank)
    try:
        worker.run()
    finally:
        worker.release()
        synchronize(device)


def serve_torchrun_rank(config: EngineConfig) -> int:
    """A torchrun rank above 0 (the CLI runs this instead of its command there)."""
    from infer.distributed.group import torchrun_rank
    launch = torchrun_rank()
    if launch is None or launch.rank == 0:
        raise RuntimeError("serve_torchrun_rank runs on torchrun's ranks above 0")
    if launch.world_size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {launch.world_size} processes but tensor_parallel_size is "
                         f"{config.tensor_parallel_size}: they must be equal")
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torchrun_device(config.device, launch.local_rank, cuda_count)
    group = join(launch.rank, launch.world_size, device, None, config.tensor_parallel_all_reduce)
    try:
        serve_rank(config, launch.rank, device, group)
    finally:
        leave(group.collectives)
    return 0


def watch_driver(fd: int) -> None:
    """Exit this process as soon as pipe `fd` (held open by the driver) reaches end of file
    (raw reads: a blocked buffered read would hold its lock at exit)."""
    def watch() -> None:
        while os.read(fd, 4096):
            pass
        print(f"infer tensor-parallel worker {os.getpid()}: the driver has gone; exiting", file=sys.stderr,
              flush=True)
        os._exit(EXIT_DRIVER_GONE)

    threading.Thread(target=watch, name="infer-tp-driver-watch", daemon=True).start()


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the driver closed the pipe before sending the worker's spec")
        data += chunk
    return data


def read_spec(fd: int) -> WorkerSpec:
    size = int.from_bytes(_read_exactly(fd, 8), "little")
    spec = pickle.loads(_read_exactly(fd, size))
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"expected a WorkerSpec on stdin, got {type(spec).__name__}")
    return spec


def main(ready_fd: int) -> int:
    stdin = sys.stdin.fileno()
    spec = read_spec(stdin)
    watch_driver(stdin)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    device = torch.device(spec.device)
    group = join(spec.rank, spec.world_size, device, store, spec.config.tensor_parallel_all_reduce)
    try:
        serve_rank(spec.config, spec.rank, device, group)
    finally:
        leave(group.collectives)
    return 0

