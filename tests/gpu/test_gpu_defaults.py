"""The fast path by default on a GPU (run on the GPU machine: `pytest -m gpu tests/gpu`).

With no speed flags an engine on CUDA captures CUDA graphs for the batch sizes 1, 2, 4, ...
up to max_batch_size and compiles the fused kernels; `use_cuda_graphs=False` (the CLI's
`--enforce-eager`) turns both off. The start-up line counts the graphs. The context defaults
to the model's own; past the graphs' context width (8192) steps run eagerly and give the
same tokens as an engine with no graphs at all. Speculation's batch gate is on.
"""

from __future__ import annotations

import logging
import random

import pytest

from helpers.checkpoints import make_checkpoint
from infer import LLM, SamplingParams
from infer.engine.executor.capture import MAX_GRAPH_CONTEXT
from infer.engine.executor.batch_forward import GraphBatchForward
from infer.models.kernels.bundle import EAGER

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_cuda_graphs_and_fused_kernels_are_the_default(ckpt_a, caplog):
    kw = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128)
    with caplog.at_level(logging.INFO, logger="infer.engine"):
        fast = LLM(str(ckpt_a), **kw)
    runner = fast.engine.runner
    assert fast.engine.resolved.execution.use_cuda_graphs is True and runner.kernels.name == "fused"
    assert isinstance(runner.forward_fn, GraphBatchForward) and sorted({n for n, _ in runner.forward_fn.graphs}) == [1, 2, 4]
    ready = [r.message for r in caplog.records if r.message.startswith("engine ready in")]
    assert len(ready) == 1 and f"{fast.engine.startup.num_graphs()} CUDA graphs captured in" in ready[0]
    assert fast.engine.startup.num_graphs() >= 3
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    assert eager.engine.runner.kernels is EAGER and not isinstance(eager.engine.runner.forward_fn, GraphBatchForward)
    graphs_only = LLM(str(ckpt_a), compile_kernels=False, **kw)  # graphs (the default) with the eager kernels
    prompts = [[random.Random(i).randrange(3, 200) for _ in range(5 + i)] for i in range(3)]
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
              for llm in (eager, graphs_only)]
    assert tokens[0] == tokens[1] and graphs_only.engine.runner.forward_fn.replays > 0
    for llm in (fast, eager, graphs_only):
        assert llm.engine.leak_report() == []


def test_contexts_past_the_graphs_width_run_eagerly_with_the_same_tokens(tmp_path):
    ckpt = make_checkpoint(tmp_path / "long", max_position_embeddings=2 * MAX_GRAPH_CONTEXT, head_dim=16)
    kw = dict(device="cuda", dtype="float32", max_batch_size=2, compile_kernels=False)
    graphs = LLM(str(ckpt), **kw)
    assert graphs.engine.resolved.scheduler.max_seq_len == 2 * MAX_GRAPH_CONTEXT  # the model's own context
    assert graphs.engine.runner.forward_fn.context_width == MAX_GRAPH_CONTEXT
    eager = LLM(str(ckpt), use_cuda_graphs=False, **kw)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(MAX_GRAPH_CONTEXT + 100)], [5, 6, 7]]
    want = [o.outputs[0].token_ids for o in eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    before = graphs.engine.runner.forward_fn.replays
    got = [o.outputs[0].token_ids for o in graphs.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert got == want
    short = [o.outputs[0].token_ids for o in graphs.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY)]
    assert short == want[1:] and graphs.engine.runner.forward_fn.replays > before  # short contexts replay
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []


def test_the_batch_gate_is_on_by_default_and_keeps_greedy_tokens(ckpt_a, tmp_path):
    # a draft that is never right, the gate deciding from the wall clock which steps draft:
    # whatever it decides, the tokens stay plain decoding's (its decisions are timing, which
    # tests do not assert: tests/unit/test_round_clock.py drives it on simulated times)
    kw = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256, compile_kernels=False)
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    prompts = [[random.Random(i).randrange(3, 200) for _ in range(5 + i)] for i in range(4)]
    plain = LLM(str(ckpt_a), **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    draft = make_checkpoint(tmp_path / "draft", variant="a", seed=123, num_hidden_layers=1, head_dim=16)
    gated = LLM(str(ckpt_a), draft_model=str(draft), spec_length=4, **kw)
    clock = gated.engine.runner.speculation.clock
    assert clock is not None and clock.gate and gated.engine.resolved.speculative.batch_gate
    assert [o.outputs[0].token_ids for o in gated.generate(prompt_token_ids=prompts, sampling_params=params)] == want
    assert gated.engine.leak_report() == []
