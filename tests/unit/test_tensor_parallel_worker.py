"""What a tensor-parallel worker is asked to build and run, and how its pools follow the driver's, on the CPU.

The driver's side (`TensorParallelExecutor`) runs the real runners' start-up, a chain
speculative runner and a tree runner each with a draft model sharded like the target, and
its messages are recorded instead of broadcast; a `Worker` then handles them with an
executor that records each `ForwardSpec` it is given and each method invoked. The worker
builds the driver's forward functions (the same graphs) and is invoked only for the forward
part of each call. A worker's pool keeps no bookkeeping: its block tables follow the
driver's through the entries each message carries, its KV rows move as the driver's do,
and a report names tables that differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.distributed.worker as worker_module
from infer.cache.block_tables import BlockTables, last_writes
from infer.cache.protocol import CachePoolProtocol
from infer.distributed.tp_executor import Outbox, TensorParallelExecutor
from infer.distributed.protocol import INVOKABLE, Invoke, MakeForward, Message, Report, WorkerReport
from infer.distributed.worker import Worker
from infer.engine.config import EngineConfig
from infer.engine.defaults import resolve_config
from infer.engine.executor.factory import LocalExecutor
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.engine.loading import load_models_for
from infer.engine.runner import ModelRunner
from infer.models.llama import LlamaForCausalLM


class _Channel:
    """A ControlChannel that keeps what the driver sends and what a worker reports."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.reports: list[WorkerReport] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def gather_reports(self, report: WorkerReport) -> list[WorkerReport]:
        self.reports.append(report)
        return []


class _RecordingForward:
    """Records the methods a worker invokes (and runs nothing: only what is asked is counted)."""

    def __init__(self, calls: list[tuple[str, tuple[object, ...]]]) -> None:
        self.calls = calls

    def __getattr__(self, method: str) -> Any:  # noqa: ANN401 - any ForwardFn method
        return lambda *args: self.calls.append((method, args))

    def __call__(self, *args: object) -> None:
        self.calls.append(("__call__", args))


class _RecordingExecutor(LocalExecutor):
    def __init__(self) -> None:
        self.specs: list[ForwardSpec] = []
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def make_forward(self, model: LlamaForCausalLM, pool: CachePoolProtocol, spec: ForwardSpec) -> ForwardFn:
        self.specs.append(spec)
        return _RecordingForward(self.calls)  # type: ignore[return-value]


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[_RecordingExecutor]:
    executor = _RecordingExecutor()
    monkeypatch.setattr(worker_module, "LOCAL", executor)
    yield executor


@pytest.mark.parametrize("tree", [None, "2,2"])
def test_a_worker_builds_the_driver_s_forwards_and_runs_their_forward_part(ckpt_b: Path,
                                                                           recording: _RecordingExecutor,
                                                                           tree: str | None) -> None:
    config = EngineConfig(model=str(ckpt_b), device="cpu", max_seq_len=64, max_batch_size=4, use_cuda_graphs=False,
                          use_speculative_decoding=True, draft_model=str(ckpt_b), spec_length=2, spec_tree=tree)
    models = load_models_for(config)
    resolved = resolve_config(config, models)
    channel = _Channel()
    executor = TensorParallelExecutor(Outbox(channel), resolved.execution,  # type: ignore[arg-type]
                                      {id(models.target): "target", id(models.draft): "draft"},
                                      frozenset({"target", "draft"}))
    ModelRunner(models.target, models.tokenizer, resolved, models.eos_token_ids, executor, draft_model=models.draft)
    driver_specs = [m.call.spec for m in channel.sent if isinstance(m.call, MakeForward)]
    assert len(driver_specs) == 2  # the target's forward and the draft's
    assert driver_specs[0].trees == driver_specs[1].trees == (tree is not None)
    worker = Worker({"target": models.target, "draft": models.draft}, channel, rank=1)  # type: ignore[arg-type]
    with torch.inference_mode():
        for message in channel.sent:
            assert worker.handle(message.call)
    assert [(s.max_batch_size, s.max_tokens, s.trees) for s in recording.specs] == \
        [(s.max_batch_size, s.max_tokens, s.trees) for s in driver_specs]
    invoked = [m.call for m in channel.sent if isinstance(m.call, Invoke)]
    assert [(c.method, c.args) for c in invoked] == recording.calls
    assert all(method in INVOKABLE for method, _ in recording.calls)


def test_a_forward_spec_is_validated() -> None:
    spec = ForwardSpec(True, 8, tokens=48, trees=True)
    assert (spec.max_tokens, ForwardSpec(max_batch_size=8).max_tokens) == (48, 8)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        ForwardSpec(max_batch_size=0)
    with pytest.raises(ValueError, match="tokens must be >= 1 or None"):
        ForwardSpec(tokens=0)


def test_block_tables_journal_their_changes_for_a_follower() -> None:
    tables = BlockTables(3, 4, "cpu")
    tables.set(0, 0, [5, 6])
    follower = BlockTables(3, 4, "cpu")
    follower.apply(tables.follow())  # the entries set so far
    tables.set(1, 0, [7, 8])
    tables.set(1, 1, [9])  # (an entry changed twice between two takes: the later wins)
    tables.set(0, 2, [3])
    changes = tables.take_changes()
    assert changes.tolist() == [[1, 0, 7], [1, 1, 8], [1, 1, 9], [0, 2, 3]]
    follower.apply(changes)
    assert np.array_equal(follower.host, tables.host) and follower.host[1, 1] == 9
    assert tables.take_changes().shape == (0, 3)  # taken: nothing left
    assert sorted(last_writes(np.array([[1, 1, 8], [0, 0, 2], [1, 1, 9]]), 4).tolist()) == [[0, 0, 2], [1, 1, 9]]
    with pytest.raises(RuntimeError, match="no follower"):
        BlockTables(1, 1, "cpu").take_changes()


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_a_workers_pool_follows_the_drivers_tables_and_row_moves(ckpt_b: Path, backend: str) -> None:
    paged: dict[str, Any] = dict(block_size=4, num_blocks=24) if backend == "paged" else {}
    config = EngineConfig(model=str(ckpt_b), device="cpu", max_seq_len=64, max_batch_size=4, kv_cache_backend=backend,
                          **paged)
    models = load_models_for(config)
    model, resolved = models.target, resolve_config(config, models)
    channel = _Channel()
    executor = TensorParallelExecutor(Outbox(channel),  # type: ignore[arg-type]
                                      resolved.execution, {id(model): "target"}, frozenset({"target"}))
    pool = executor.make_pool(model, resolved.cache, prefix_caching=True)
    worker = Worker({"target": model}, channel, rank=1)  # type: ignore[arg-type]
    served: list[Message] = []

    def step() -> Message:
        """A message (a report: the worker checks its tables), served; the worker's tables must be the driver's."""
        executor.outbox.send(Report(executor.outbox.digests()))
        for message in channel.sent[len(served):]:  # (the first: the MakePool)
            assert worker.serve(message)
            served.append(message)
        assert channel.reports[-1].problems == []
        assert np.array_equal(worker.pools[0].tables.host, pool.tables.host)
        return channel.sent[-1]

    step()
    prompt = list(range(10, 30))
    a = pool.allocate_slot(20, prompt)
    pool.set_length(a, 20)
    pool.register_prefix(a, prompt)
    step()
    b = pool.allocate_slot(20, prompt)  # (paged: its first 16 tokens from the prefix cache)
    assert pool.ensure_capacity(b, 27)
    pool.set_length(b, 27)
    pool.truncate_to(b, 22)
    c = pool.allocate_slot(8)
    pool.free_slot(c)  # (its slot taken again before the next message: its entries set twice)
    assert pool.allocate_slot(12) == c
    assert bool(step().changes) == (backend == "paged")  # (contiguous tables never change)
    assert pool.ensure_capacity(b, 23)  # inside its last block: nothing to send
    assert step().changes == ()
    # a tree's accepted path moved into place: every rank copies the same rows of its KV
    for cache, theirs in ((pool.k_cache, worker.pools[0].k_cache), (pool.v_cache, worker.pools[0].v_cache)):
        cache.normal_()
        theirs.copy_(cache)
    rows = pool.rows(b, 18, 22).tolist()
    pool.move_rows(rows[2:], rows[:2])
    assert step().changes[0].moves == ((tuple(rows[2:]), tuple(rows[:2])),)
    assert torch.equal(worker.pools[0].k_cache, pool.k_cache) and torch.equal(worker.pools[0].v_cache, pool.v_cache)
    assert torch.equal(pool.k_cache[:, rows[0]], pool.k_cache[:, rows[2]])
    # a worker whose tables differ from the driver's is named in its report
    worker.pools[0].tables.host[a, 0] += 1
    executor.outbox.send(Report(executor.outbox.digests()))
    assert worker.serve(channel.sent[-1])
    assert channel.reports[-1].problems == ["pool 0: block tables differ from the driver's"]
