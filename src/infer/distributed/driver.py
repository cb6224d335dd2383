"""TensorParallelDriver: rank 0 of a tensor-parallel engine, and the lifetime of its workers.

`start_tensor_parallel(config)` checks the model shapes, starts N-1 worker processes (none under torchrun) and joins
the process groups with them. `close()` (or the finalizer) shuts them down; a worker whose driver dies sees its
stdin pipe close and exits. docs/architecture.md, "Tensor parallelism".
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from infer.distributed.channel import ControlChannel
from infer.distributed.group import (LOOPBACK, join, leave, loopback_gloo, plan_devices, torchrun_device,
                                    torchrun_rank)
from infer.distributed.tp_executor import Outbox, TensorParallelExecutor, TensorParallelForward
from infer.distributed.protocol import Report, Shutdown, WorkerReport
from infer.distributed.worker import WorkerSpec, shards_for
from infer.engine.config import EngineConfig
from infer.engine.loading import LoadedModels, model_sources
from infer.engine.parts import ExecutionConfig
from infer.models.layers.parallel import Collectives
from infer.models.layers.shard import ModelShard
from infer.models.loading.gguf.path import is_gguf_path
from infer.models.loading.loader import DUMMY_PREFIX, read_model_config
from infer.models.loading.readers import resolve_model_path
from infer.timing import synchronize

log = logging.getLogger("infer.distributed")

START_TIMEOUT_S = 300.0  # a worker must have started (imported torch, reached its store) by then
EXIT_TIMEOUT_S = 60.0  # a worker has this long to leave cleanly after Shutdown, then it is killed
# (the real module, not `python -m`'s __main__ copy: the spec's classes must be its own)
WORKER_COMMAND = "import sys; from infer.distributed.worker import main; sys.exit(main(int(sys.argv[1])))"


def start_tensor_parallel(config: EngineConfig, models: LoadedModels | None = None) -> TensorParallelDriver | None:
    """The engine's tensor-parallel driver, or None with tensor_parallel_size 1."""
    if config.tensor_parallel_size == 1:
        return None
    if models is not None:
        raise ValueError("an engine with tensor_parallel_size > 1 loads its models itself (each rank its shard): "
                         "pass no models")
    return TensorParallelDriver(config)


def _local_path(name: str) -> str:
    """A model name as the workers should load it: hub ids resolved to their local copy."""
    if name.startswith(DUMMY_PREFIX) or is_gguf_path(name):
        return name
    return str(resolve_model_path(name))


@dataclass
class _Resources:
    """What shutting down needs (held by the finalizer: nothing here refers to the driver)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    store: dist.TCPStore | None = None
    outbox: Outbox | None = None
    forwards: list[TensorParallelForward] = field(default_factory=list)
    device: torch.device = torch.device("cpu")
    joined: bool = False
    collectives: Collectives | None = None  # the group's (closed on leaving)
    # init_process_group wraps sys.excepthook (a "[rank0]:" prefix) and never unwraps it
    excepthooks: tuple[Callable[..., object], Callable[..., object]] | None = None  # (before, torch's)


def _shutdown(res: _Resources) -> None:
    told = False  # whether every worker got Shutdown (else they are killed: nothing of theirs to save)
    if res.outbox is not None and not res.outbox.closed:
        try:
            res.outbox.send(Shutdown())
            told = True
        except Exception as exc:  # noqa: BLE001 - a worker gone already: the others are killed
            log.warning("tensor-parallel shutdown could not reach every worker: %s", exc)
        res.outbox.closed = True
    for forward in res.forwards:
        forward.release()
    res.forwards.clear()
    gc.collect()
    if res.joined:
        synchronize(res.device)
        leave(res.collectives)
        res.joined = False
    if res.excepthooks is not None and sys.excepthook is res.excepthooks[1]:
        sys.excepthook = res.excepthooks[0]
    for proc in res.procs:
        if not told:
            proc.kill()
        try:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel worker %d did not exit after shutdown; killing it", proc.pid)
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
    res.store = None  # (the store's server closes its port)


def _check_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for rank, proc in enumerate(procs, start=1):
        if proc.poll() is not None:
            raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.returncode}: the engine cannot go on; close it")


class TensorParallelDriver:
    """Rank 0's side: the worker processes, the process groups, the control channel;
    `executor(models)` builds the runner's pools and forwards."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel_part()
        self.world_size = parallel.size
        target_path, draft_path, _, _ = model_sources(config)
        self.worker_config = replace(config, model=_local_path(target_path),
                                     draft_model=None if draft_path is None else _local_path(draft_path))
        self.target_shard, self.draft_shard = shards_for(parallel, 0)
        self.store_port: int | None = None  # the rendezvous store's (loopback) port; None under torchrun
        self._check_shapes(self.worker_config)
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _shutdown, self._res)
        try:
            self.device, store = self._start_ranks()
            hook = sys.excepthook
            with loopback_gloo() if store is not None else nullcontext():  # (torchrun: the user's network)
                group = join(0, self.world_size, self.device, store, parallel.all_reduce)
            self._res.device, self._res.joined, self._res.excepthooks = self.device, True, (hook, sys.excepthook)
            self._res.collectives = group.collectives
        except BaseException:
            self.close()
            raise
        # (the channel must not refer to the driver: the finalizer holds it)
        self.target_shard, self.draft_shard = shards_for(parallel, 0, group.collectives)
        self.channel = ControlChannel(group.control, 0, self.device, before_send=partial(_check_workers, self._res.procs))
        self._res.outbox = self.outbox = Outbox(self.channel)

    def _check_shapes(self, config: EngineConfig) -> None:
        """Every model to be split must divide by N: checked on the configs, before any start."""
        self.target_shard.check(read_model_config(str(config.model), config.load_format))
        if self.draft_shard is not None and config.draft_model is not None:
            self.draft_shard.check(read_model_config(config.draft_model, config.load_format))

    def _start_ranks(self) -> tuple[torch.device, dist.TCPStore | None]:
        """(this rank's device, the rendezvous store: None under torchrun)."""
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        launch = torchrun_rank()
        if launch is not None:
            if launch.rank != 0 or launch.world_size != self.world_size:
                raise ValueError(f"under torchrun the engine runs on rank 0 of tensor_parallel_size={self.world_size} "
                                 f"processes; this is rank {launch.rank} of {launch.world_size}")
            return torchrun_device(self.config.device, launch.local_rank, cuda_count), None
        if self.config.device.startswith("cuda") and cuda_count == 0:
            raise ValueError("device='cuda' but no CUDA GPU is available: use device='cpu'")
        devices = plan_devices(self.config.device, self.world_size, cuda_count)
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False)
        self._res.store, self.store_port = store, store.port
        ready = [self._spawn(WorkerSpec(rank, self.world_size, store.port, str(devices[rank]), self.worker_config))
                 for rank in range(1, self.world_size)]
        self._wait_started(ready)
        return devices[0], store

    def _spawn(self, spec: WorkerSpec) -> int:
        """Start a worker; returns the read end of its start-up pipe (one byte once it has started)."""
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # the workers import this same `infer` (src/infer/..)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if sys.platform == "linux":
            env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)  # (every rank on this machine)
        ready_r, ready_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND, str(ready_w)], stdin=subprocess.PIPE,
                                    env=env, start_new_session=True, pass_fds=(ready_w,))
        finally:
            os.close(ready_w)
        self._res.procs.append(proc)
        assert proc.stdin is not None
        data = pickle.dumps(spec)
        proc.stdin.write(len(data).to_bytes(8, "little") + data)
        proc.stdin.flush()  # (and the pipe stays open: its end tells the worker the driver is gone)
        return ready_r

    def _wait_started(self, ready: list[int]) -> None:
        """Wait for every worker's start-up byte; a worker that exits first closes its pipe."""
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for rank, (proc, fd) in enumerate(zip(self._res.procs, ready, strict=True), start=1):
                if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    raise TimeoutError(f"tensor-parallel worker rank {rank} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s")
                if os.read(fd, 1) != b"1":
                    raise RuntimeError(f"tensor-parallel worker rank {rank} exited during start-up with code "
                                       f"{proc.wait()} (its messages are above)")
        finally:
            for fd in ready:
                os.close(fd)

    # -- the engine's view ---------------------------------------------------------------------
    def executor(self, models: LoadedModels, execution: ExecutionConfig) -> TensorParallelExecutor:
        """The executor of the engine's runner: the target (and a sharded draft) on every rank."""
        roles = {id(models.target): "target"}
        split = {"target"}
        if models.draft is not None:
            roles[id(models.draft)] = "draft"
            if self.draft_shard is not None:
                split.add("draft")
        executor = TensorParallelExecutor(self.outbox, execution, roles, frozenset(split))
        self._res.forwards = executor.forwards
        return executor

    @property
    def shards(self) -> tuple[ModelShard, ModelShard | None]:
        """(the driver's target shard, its draft shard or None: the draft loads whole)."""
        return self.target_shard, self.draft_shard

    @property
    def workers(self) -> tuple[subprocess.Popen[bytes], ...]:
        """The worker processes this driver started (none under torchrun), rank 1 first."""
        return tuple(self._res.procs)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._res.procs]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def reports(self) -> list[WorkerReport]:
        """Every worker's report: where its block tables differ from the driver's, the CUDA
        graphs it captured ([] once closed)."""
        if self.closed:
            return []
        self.outbox.send(Report(self.outbox.digests()))
        return self.channel.gather_reports(None)

    def leak_report(self) -> list[str]:
        """The workers' problems: block tables that differ from the driver's."""
        return [f"rank {r.rank}: {p}" for r in self.reports() for p in r.problems]

    def close(self) -> None:
        """End the workers and leave the process groups (idempotent)."""
        self._finalizer()
