"""What a tensor-parallel worker is asked to build and run, counted on the CPU.

The driver's side (`TensorParallelExecutor`) runs the real runners' start-up, a chain
speculative runner and a tree runner each with a draft model sharded like the target, and
its messages are recorded instead of broadcast; a `Worker` then handles them with an
executor that records each `ForwardSpec` it is given and each method invoked. The worker
builds the driver's forward functions (the same graphs) and is invoked only for the forward
part of each call.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import infer.distributed.worker as worker_module
from infer.cache.protocol import CachePoolProtocol
from infer.distributed.mirror import Outbox, TensorParallelExecutor
from infer.distributed.protocol import INVOKABLE, Invoke, MakeForward, Message
from infer.distributed.worker import Worker
from infer.engine.config import EngineConfig
from infer.engine.executor.factory import LocalExecutor
from infer.engine.executor.forward import ForwardFn
from infer.engine.executor.spec import ForwardSpec
from infer.engine.loading import load_models
from infer.engine.runner import ModelRunner
from infer.models.llama import LlamaForCausalLM


class _Channel:
    """A ControlChannel that keeps what the driver sends."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)


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
    models = load_models(config)
    channel = _Channel()
    executor = TensorParallelExecutor(Outbox(channel), config,  # type: ignore[arg-type]
                                      {id(models.target): "target", id(models.draft): "draft"},
                                      frozenset({"target", "draft"}))
    ModelRunner(models.target, models.tokenizer, config, models.eos_token_ids, executor, draft_model=models.draft)
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
