"""Tree speculation on the GPU (issue #37; run on the GPU machine: `pytest -m gpu tests/gpu`).

CUDA-graph replay of tree chunks (the target's verification block, a draft model's levels)
and of the tree verifier must give the same tokens as eager execution, float32, both
backends, batch 1 and a batch padded to a bucket, greedy and seeded sampling, static trees
and a draft model's dynamic trees; the fused kernels' path (rotary + cache write in one
kernel, then attention with the block mask) must match the eager kernels on a tree chunk;
suffix decoding's rounds replay as eager ones.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.checkpoints import encode
from infer import LLM, SamplingParams
from infer.speculative.tree import TreeShape

pytestmark = pytest.mark.gpu

TREE = "3,2,1"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(model_dir, n=6):
    rng = random.Random(5)
    words = "the cat sat on the mat and a dog ran to the park while birds sang".split()
    return [encode(model_dir, " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))) for _ in range(n)]


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _pair(ckpt, backend, method, **extra):
    kw = dict(device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=8, max_seq_len=128,
              compile_kernels=False, use_speculative_decoding=True, spec_batch_gate=False, speculative_method=method,
              **{"spec_tree": TREE, **extra})
    if method == "draft_model":
        kw["draft_model"] = str(ckpt)
    return LLM(str(ckpt), use_cuda_graphs=False, **kw), LLM(str(ckpt), use_cuda_graphs=True, **kw)


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("method, tree", [("draft_model", TREE), ("ngram", TREE), ("draft_model", "dynamic:8:2")])
def test_tree_graphs_token_identical_to_eager(ckpt_a, backend, method, tree):
    # static trees, and a draft model's dynamic trees (levels of each row's best nodes)
    prompts = _prompts(ckpt_a)
    eager, graphs = _pair(ckpt_a, backend, method, spec_tree=tree, spec_length=3)
    for batch in ([prompts[0]], prompts):  # batch 1, and 6 rows padded to the bucket of 8
        assert _tokens(graphs, batch) == _tokens(eager, batch)
    runner = graphs.engine.runner
    assert {ruled for _, ruled in runner.forward_fn.graphs} == {False, True}  # tree rules in graphs of their own
    assert runner.forward_fn.replays > 0
    if method == "draft_model":
        assert runner.speculation.draft.step_forward.replays > 0  # the draft's levels replayed too
    if method == "draft_model" and tree == TREE:
        stats = runner.stats  # the target drafting for itself: (nearly) the full depth every round
        assert stats.accepted_tokens >= 0.99 * sum(stats.drafted_per_position)
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("general", [False, True])
def test_sampled_tree_rounds_replay_identically(ckpt_a, backend, general):
    # seeded temperature rows (and a greedy row) through the tree graphs and the fused
    # acceptance; with a top-k row the batch takes the general pipeline
    prompts = _prompts(ckpt_a, 4)
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=11 + i,
                             top_k=5 if general and i == 1 else 0) for i, t in enumerate([0.8, 1.0, 0, 1.3])]
    eager, graphs = _pair(ckpt_a, backend, "draft_model")
    assert _tokens(graphs, prompts, params) == _tokens(eager, prompts, params)
    assert graphs.engine.runner.forward_fn.replays > 0
    assert graphs.engine.runner.stats.accepted_tokens > 0
    assert graphs.engine.leak_report() == []


@pytest.mark.parametrize("backend, shape", [("contiguous", dict(spec_tree="dynamic:12:3", spec_length=6)),
                                            ("paged", dict(spec_tree="dynamic:12:3", spec_length=6)),
                                            ("paged", {})])
def test_suffix_rounds_replay_identically(ckpt_a, backend, shape):
    # suffix decoding's rounds (trees walked eagerly over their round's frame, or chains; {}:
    # its defaults, chains of up to 24) through the graphs: greedy and seeded rows as eager,
    # greedy ones as plain decoding; the prompts twice, the second time drafted from the
    # cache of the first outputs
    prompts = _prompts(ckpt_a, 4)
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=21 + i)
              for i, t in enumerate([0, 0.8, 0, 1.0])]
    kw = dict(device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=8, max_seq_len=128,
              compile_kernels=False, spec_batch_gate=False, speculative_method="suffix", **shape)
    eager, graphs = LLM(str(ckpt_a), use_cuda_graphs=False, **kw), LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    plain = _tokens(LLM(str(ckpt_a), device="cuda", dtype="float32", max_seq_len=128, use_cuda_graphs=False),
                    prompts, GREEDY)
    for _ in range(2):
        got = _tokens(graphs, prompts, params)
        assert got == _tokens(eager, prompts, params)
        assert [got[0], got[2]] == [plain[0], plain[2]]
    assert graphs.engine.runner.forward_fn.replays > 0 and graphs.engine.runner.stats.accepted_tokens > 0
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []


@torch.no_grad()
def test_tree_chunk_with_fused_kernels_matches_eager_kernels(ckpt_a):
    from infer.cache.factory import make_cache_pool
    from infer.cache.forward_batch import Row, build_batch, plan_batch
    from infer.engine.executor.batch_forward import run_model
    from infer.engine.verification import block_row
    from infer.models.kernels.bundle import EAGER, compiled_kernels
    from infer.models.loading.loader import load_model
    from infer.speculative.tree import Draft
    model, _ = load_model(str(ckpt_a), dtype="bfloat16", device="cuda")
    shape = TreeShape.parse(TREE)
    outs = []
    for kernels in (EAGER, compiled_kernels()):
        pool = make_cache_pool("paged", model.config, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16,
                               device=torch.device("cuda"), block_size=4, enable_prefix_caching=False)
        slots = [pool.allocate_slot(30) for _ in range(2)]
        gen = torch.Generator().manual_seed(0)
        history = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (8, 14)]
        for slot, ids in zip(slots, history, strict=True):
            batch = build_batch(plan_batch([Row(slot, 0, ids[:-1], logits=0)]), pool.tables, pool.block_size,
                                pool.scratch_row, "cuda")
            run_model(model, pool, batch, EAGER)
            pool.set_length(slot, len(ids) - 1)
        nodes = torch.randint(0, 300, (2, shape.num_nodes), generator=gen).tolist()
        valid = [(True,) * shape.num_nodes, (True,) * 9 + (False,) * (shape.num_nodes - 9)]
        requests = [_Pending(slot, ids) for slot, ids in zip(slots, history, strict=True)]
        rows = [block_row(r, Draft(shape, tuple(t if ok else 0 for t, ok in zip(n, v, strict=True)), v))
                for r, n, v in zip(requests, nodes, valid, strict=True)]
        batch = build_batch(plan_batch(rows), pool.tables, pool.block_size, pool.scratch_row, "cuda")
        hidden = run_model(model, pool, batch, kernels)
        outs.append(model.logits(hidden.index_select(0, batch.logits_indices), kernels).float())
    # bf16: the fused kernel rounds the rotation differently, so the logits agree to within a
    # small fraction of their scale
    want, got = outs
    assert (got - want).abs().max() <= 0.03 * want.abs().max()


class _Pending:
    """A request as a verification row reads it: its slot, the position of g and g."""

    def __init__(self, slot: int, ids: list[int]) -> None:
        self.slot, self.num_computed_tokens, self.last_token_id = slot, len(ids) - 1, ids[-1]
