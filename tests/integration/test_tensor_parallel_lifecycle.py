"""Tensor-parallel worker processes live exactly as long as their engine (CPU, gloo, 2 ranks).

- An LLM deleted (and collected) ends its worker: it exits 0, this process leaves the
  process group, the rendezvous store's port closes.
- A driver killed with SIGKILL leaves no orphan; a worker exits as soon as the pipe its
  driver holds closes, wherever its main thread is blocked.
- `close()` is idempotent, and the engine refuses work afterwards.
- Errors in the configuration (heads that do not divide, more ranks than GPUs) come before
  any process starts.
- torchrun: the same command line on two ranks prints what one process prints.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.checkpoints import encode
from infer import LLM, SamplingParams
from infer.distributed.worker import EXIT_DRIVER_GONE

EXIT_WAIT_S = 30.0
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
needs_pidfd = pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "pidfd_open"),
                                 reason="waits on processes through pidfd_open (Linux)")


def _exited(pid_fds: list[int], timeout: float = EXIT_WAIT_S) -> bool:
    """Whether every process (pidfds opened while it lived) has exited within `timeout`."""
    try:
        for fd in pid_fds:
            if not select.select([fd], [], [], timeout)[0]:
                return False
        return True
    finally:
        for fd in pid_fds:
            os.close(fd)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _children() -> set[int]:
    """This process's child processes (Linux: every thread's children)."""
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        out |= {int(p) for p in (task / "children").read_text().split()}
    return out


@needs_pidfd
def test_workers_exit_when_the_llm_is_deleted(tp_ckpt: Path) -> None:
    llm = LLM(str(tp_ckpt), device="cpu", max_seq_len=64, tensor_parallel_size=2)
    prompt = encode(tp_ckpt, "the quick brown fox")
    assert len(llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].outputs[0].token_ids) == 6
    driver = llm.engine.parallel
    assert driver is not None and dist.is_initialized()
    workers, port = driver.workers, driver.store_port
    assert len(workers) == 1 and port is not None and _port_open(port)
    fds = [os.pidfd_open(w.pid) for w in workers]
    del llm, driver
    gc.collect()
    assert _exited(fds)
    assert [w.returncode for w in workers] == [0]  # a clean exit, not a kill
    assert not dist.is_initialized()
    assert not _port_open(port)


@needs_pidfd
def test_close_ends_the_workers_once_and_the_engine_refuses_work(tp_ckpt: Path) -> None:
    with LLM(str(tp_ckpt), device="cpu", max_seq_len=64, tensor_parallel_size=2) as llm:
        driver = llm.engine.parallel
        assert driver is not None
        fds = [os.pidfd_open(w.pid) for w in driver.workers]
    assert _exited(fds) and [w.returncode for w in driver.workers] == [0]
    llm.close()  # again: nothing left to do
    assert driver.closed and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)
    assert llm.engine.leak_report() == []  # the aborted request's slot went back


DRIVER = """
import sys
from infer import LLM, SamplingParams
from infer.distributed.worker import EXIT_DRIVER_GONE
llm = LLM(sys.argv[1], device="cpu", max_seq_len=64, tensor_parallel_size=2)
llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0, max_tokens=4))
print(*llm.engine.parallel.worker_pids, flush=True)
sys.stdin.read()  # until the test kills this process
"""


@needs_pidfd
def test_no_orphan_when_the_driver_is_killed(tp_ckpt: Path) -> None:
    env = {**os.environ, "INFER_TEST_THREADS": "1"}  # (NCCL_NVLS_ENABLE and the rest as they are)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tp_ckpt)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]  # (EOF, no pids, if the driver failed)
        assert len(pids) == 1
        fds = [os.pidfd_open(p) for p in pids]
        driver.send_signal(signal.SIGKILL)
        assert driver.wait(timeout=EXIT_WAIT_S) == -signal.SIGKILL
        assert _exited(fds)  # the worker noticed at once: no orphan left
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if driver.stdin is not None:
            driver.stdin.close()
        if driver.stdout is not None:
            driver.stdout.close()


WATCHED = """
import threading
from infer.distributed.worker import watch_driver
watch_driver(0)
print("watching", flush=True)
threading.Event().wait()  # the main thread blocked for good, as in a collective whose peer died
"""


def test_a_worker_exits_as_soon_as_its_drivers_pipe_closes() -> None:
    proc = subprocess.Popen([sys.executable, "-c", WATCHED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline() == "watching\n"
        proc.stdin.close()  # what the kernel does to a killed driver's end of the pipe
        assert proc.wait(timeout=EXIT_WAIT_S) == EXIT_DRIVER_GONE
        assert "the driver has gone" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.skipif(sys.platform != "linux", reason="lists child processes through /proc")
def test_heads_that_do_not_divide_fail_before_any_process_starts(tp_ckpt: Path) -> None:
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split this model: .*"
                                         r"num_key_value_heads \(4\).* not divisible by 3"):
        LLM(str(tp_ckpt), device="cpu", tensor_parallel_size=3)
    assert _children() == before and not dist.is_initialized()


@pytest.mark.skipif(sys.platform != "linux", reason="lists child processes through /proc")
def test_more_ranks_than_gpus_fail_before_any_process_starts(tp_ckpt: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 CUDA devices .* this machine has 1"):
        LLM(str(tp_ckpt), device="cuda", tensor_parallel_size=2)
    assert _children() == before and not dist.is_initialized()


def test_torchrun_ranks_print_what_one_process_prints(tp_ckpt: Path) -> None:
    prompt = "the quick brown fox"
    with LLM(str(tp_ckpt), device="cpu") as llm:
        text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "infer.cli", "generate",
                          "--model", str(tp_ckpt), "--device", "cpu", "--tensor-parallel-size", "2",
                          "--prompt", prompt, "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "INFER_TEST_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(prompt + text)
    assert "[8 tokens in" in run.stdout
