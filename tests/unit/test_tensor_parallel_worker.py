"""What a tensor-parallel worker is asked to build and run, counted on the CPU.

The driver's side (`TensorParallelExecutor`) runs the real runners' start-up, a chain
speculative runner and a tree runner each with a draft model sharded like the target, and
its messages are recorded instead of broadcast; a `Worker` then handles them with an
executor that records each `ForwardSpec` it is given and each method invoked. The driver
asks for sampling and acceptance graphs; the worker must capture none of them, keep no draft
probabilities, and be invoked only for the forward part of each call.
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
def test_a_worker_captures_no_sampling_or_acceptance_step(ckpt_b: Path, recording: _RecordingExecutor,
                                                          tree: str | None) -> None:
    config = EngineConfig(model=str(ckpt_b), device="cpu", max_seq_len=64, max_batch_size=4, use_cuda_graphs=True,
                          use_speculative_decoding=True, draft_model=str(ckpt_b), spec_length=2, spec_tree=tree)
    models = load_models(config)
    channel = _Channel()
    executor = TensorParallelExecutor(Outbox(channel), config,  # type: ignore[arg-type]
                                      {id(models.target): "target", id(models.draft): "draft"},
                                      frozenset({"target", "draft"}))
    ModelRunner(models.target, models.tokenizer, config, models.eos_token_ids, executor, draft_model=models.draft)

    driver_specs = [m.call.spec for m in channel.sent if isinstance(m.call, MakeForward)]
    assert any(s.sample_widths for s in driver_specs)
    # (a chain's acceptance graphs come with its spec; a tree's verifier with `prepare_trees`)
    assert any(s.verify_modes for s in driver_specs) == (tree is None)
    assert all(s.draft_probs for s in driver_specs)
    worker = Worker({"target": models.target, "draft": models.draft}, channel, rank=1)  # type: ignore[arg-type]
    with torch.inference_mode():
        for message in channel.sent:
            assert worker.handle(message.call)
    # the same forward graphs as the driver's, and nothing after them
    assert [s.shapes for s in recording.specs] == [s.shapes for s in driver_specs]
    assert [s.small_batch_shapes for s in recording.specs] == [s.small_batch_shapes for s in driver_specs]
    assert [(s.sample_widths, s.verify_modes, s.draft_probs) for s in recording.specs] == \
        [((), (), False)] * len(driver_specs)
    invoked = [m.call for m in channel.sent if isinstance(m.call, Invoke)]
    assert [(c.method, c.args) for c in invoked] == recording.calls
    assert {m for m, _ in recording.calls} == ({"prepare_draft_loops"} if tree is None else {"prepare_trees"})
    for method, args in recording.calls:
        assert method in INVOKABLE
        if method == "prepare_trees":  # the tree graphs only: no verifier modes reach the worker
            assert len(args) == 1 and args[0]


def test_a_forward_spec_is_validated_and_its_worker_view_keeps_the_forward_graphs() -> None:
    spec = ForwardSpec(True, 8, shapes=[(1, False), (3, True)], sample_widths=[1], verify_modes=("greedy",),
                       small_batch_shapes=[(16, False)])
    assert spec.shapes == ((1, False), (3, True)) and spec.sample_widths == (1,)  # lists kept as tuples
    worker = spec.forward_only()
    assert (worker.use_cuda_graphs, worker.max_batch_size, worker.shapes, worker.small_batch_shapes) == \
        (True, 8, spec.shapes, spec.small_batch_shapes)
    assert (worker.sample_widths, worker.verify_modes, worker.draft_probs) == ((), (), False)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        ForwardSpec(max_batch_size=0)
    with pytest.raises(ValueError, match=r"shapes: each shape is \(width >= 1, all_logits: bool\), got \(0, True\)"):
        ForwardSpec(shapes=[(0, True)])
    with pytest.raises(ValueError, match="verify_modes must be among"):
        ForwardSpec(verify_modes=("sampled",))
    with pytest.raises(ValueError, match="sample_widths must be widths >= 1"):
        ForwardSpec(sample_widths=(0,))
    with pytest.raises(ValueError, match="sampling_batch_max must be >= 0"):
        ForwardSpec(sampling_batch_max=-1)
