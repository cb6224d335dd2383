"""GPU tests of EAGLE heads (run on the GPU machine: `pytest -m gpu tests/gpu/test_gpu_eagle.py`).

A head's rounds replayed as CUDA graphs of the flat batch (engine/executor/head_graphs.py:
the feed's rows staged as the forwards' are, the draft steps built on the device) give the
same greedy tokens as the eager head, EAGLE and EAGLE-3, batch 1 and a batch that pads to a
row and token bucket, and seeded sampled rounds the same tokens as well; one round replayed
drafts the eager round's tokens and q, writes the same KV, and its padding rows and tokens
only the scratch row; a static tree (eager head levels as flat rows, the target's
verification as a CUDA graph in its greedy or "draft_probs" mode) the same tokens as
without graphs; nothing leaks. The head through the fused bundle: its forward and logits
match EAGER's to bf16 rounding (the GEMV route at one row), and with CUDA graphs and
compiled kernels its rounds run its own fused bundle and draft what the eager kernels draft
(float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.eagle_heads import write_head
from helpers.spec_e2e import word_prompts
from infer import LLM, SamplingParams
from infer.cache.factory import make_cache_pool
from infer.cache.forward_batch import Row, plan_batch
from infer.engine.executor.head_graphs import HeadRoundGraphs
from infer.models.kernels.bundle import EAGER
from infer.models.layers.attention import NoCacheView
from infer.models.loading.eagle_files import load_eagle_head
from infer.models.loading.loader import load_model
from infer.speculative.eagle_round import AheadFeed, EagerHeadRound

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_heads(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_heads")
    return {"eagle3": write_head(root / "eagle3", ckpt_a, "eagle3", draft_vocab=120, aux_layers=[0, 1, 1]),
            "eagle": write_head(root / "eagle", ckpt_a, "eagle", fc_bias=True)}


def _outputs(ckpt: Path, head: Path, method: str, graphs: bool, prompts: list[list[int]],
             params: list[SamplingParams], **options) -> tuple[list[list[int]], LLM]:
    options = {"compile_kernels": False, **options}
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_batch_size=4, max_seq_len=256,
              use_cuda_graphs=graphs, use_speculative_decoding=True, spec_batch_gate=False, speculative_method=method,
              draft_model=str(head), spec_length=3, **options)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.leak_report() == []
    return outs, llm


@pytest.mark.parametrize("temperature", [0.0, 1.0, "mixed"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_graphs_token_identical_to_eager(ckpt_a, gpu_heads, method, batch, temperature):
    # ("mixed": greedy rows, drafted ahead, beside sampled ones drafting after the verdict)
    prompts = word_prompts(ckpt_a, 6)
    params = [SamplingParams(temperature=(s % 2) * 1.0 if temperature == "mixed" else temperature, max_tokens=20,
                             ignore_eos=True, seed=s) for s in range(6)]
    eager, _ = _outputs(ckpt_a, gpu_heads[method], method, False, prompts[:batch], params[:batch])
    graphed, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts[:batch], params[:batch])
    assert graphed == eager
    proposer = llm.engine.runner.speculation.proposer
    assert proposer.round_fn.replays > 0  # the rounds ran as graphs
    # (rows, tokens, steps, greedy, ahead): feeds of up to spec_length + 1 = 4 tokens a row, and
    # greedy rounds drafted ahead (every row fed 4), captured at start
    buckets = {1: (1, 2, 4), 2: (2, 4, 8), 4: (4, 8, 16)}
    wanted = {(r, t, 3, g, False) for r, ts in buckets.items() for t in ts for g in (True, False)}
    wanted |= {(r, 4 * r, 3, True, True) for r in buckets}
    assert wanted <= set(proposer.round_fn.graphs)
    assert (proposer.ahead_rounds > 0) == (temperature != 1.0)


@pytest.mark.parametrize("greedy", [True, False])
def test_one_round_graph_drafts_and_writes_what_the_eager_round_does(ckpt_a, gpu_heads, greedy):
    """Three rows feeding 3, 1 and 2 tokens (a graph of 4 rows, 8 tokens: a padding row and
    two padding tokens), three steps, on two pools in the same state: the same tokens, the
    same q, the same KV at every real position, nothing else written but the scratch row."""
    target = load_model(str(ckpt_a), dtype="float32", device="cuda")[0]
    head = load_eagle_head(str(gpu_heads["eagle3"]), "eagle3", target)
    gen = torch.Generator(device="cuda").manual_seed(7)
    pools = [make_cache_pool("paged", head.config, max_batch_size=4, max_seq_len=64, dtype=torch.float32,
                             device="cuda", block_size=4, num_blocks=64) for _ in range(2)]
    starts, feeds, steps = (9, 3, 17), ([5, 6, 7], [8], [9, 10]), 3
    taken = [[pool.allocate_slot(s + len(f) + steps - 1) for s, f in zip(starts, feeds)] for pool in pools]
    slots = taken[0]
    assert taken[1] == slots
    for pool in pools:
        for slot, s in zip(slots, starts):
            pool.set_length(slot, s)
    kv = torch.randn(pools[0].k_cache.shape, device="cuda", generator=gen)
    for pool in pools:
        pool.k_cache.copy_(kv)
        pool.v_cache.copy_(kv.flip(0))
    plan = plan_batch([Row(slot, s, f) for slot, s, f in zip(slots, starts, feeds)])
    features = torch.randn(plan.num_tokens, head.spec.hidden_size, device="cuda", generator=gen)
    temperatures, flags = [1.0, 0.7, 1.3], [greedy] * 3
    uniforms = torch.rand(3, steps, dtype=torch.float64)
    graphs = HeadRoundGraphs(head, pools[0], max_batch_size=4, sampling_batch_max=32)
    with torch.inference_mode():
        got = graphs(plan, features, steps, temperatures, uniforms, flags)
        want = EagerHeadRound(head, pools[1])(plan, features, steps, temperatures, uniforms, flags)
    assert graphs.replays == 1 and set(graphs.graphs) == {(4, 8, steps, greedy, False)}
    assert torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) == greedy
    if not greedy:
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    scratch = pools[0].scratch_row
    for cache in ("k_cache", "v_cache"):
        a, b = getattr(pools[0], cache), getattr(pools[1], cache)
        torch.testing.assert_close(a[:, :scratch], b[:, :scratch], atol=1e-5, rtol=1e-5)
        initial = kv if cache == "k_cache" else kv.flip(0)
        assert not torch.equal(a[:, :scratch], initial[:, :scratch])  # (the round wrote its positions)
    assert [pools[0].seq_len(s) for s in slots] == [pools[1].seq_len(s) for s in slots] == \
        [s + len(f) + steps - 1 for s, f in zip(starts, feeds)]


def test_round_graph_drafted_ahead_drafts_and_writes_what_the_eager_round_does(ckpt_a, gpu_heads):
    """A greedy round drafted ahead (three rows fed their whole blocks of 4, accepting 0, 3
    and 1; ids and counts on the device) by its graph and eagerly: the same tokens, the same
    KV everywhere but the scratch row."""
    target = load_model(str(ckpt_a), dtype="float32", device="cuda")[0]
    head = load_eagle_head(str(gpu_heads["eagle3"]), "eagle3", target)
    gen = torch.Generator(device="cuda").manual_seed(5)
    pools = [make_cache_pool("paged", head.config, max_batch_size=4, max_seq_len=64, dtype=torch.float32,
                             device="cuda", block_size=4, num_blocks=64) for _ in range(2)]
    starts, steps = (9, 3, 17), 3
    slots = [[pool.allocate_slot(s + 2 * steps) for s in starts] for pool in pools][0]
    kv = torch.randn(pools[0].k_cache.shape, device="cuda", generator=gen)
    for pool in pools:
        for slot, s in zip(slots, starts):
            pool.set_length(slot, s)
        pool.k_cache.copy_(kv)
        pool.v_cache.copy_(kv.flip(0))
    plan = plan_batch([Row(slot, s, [0] * 4) for slot, s in zip(slots, starts)])
    features = torch.randn(plan.num_tokens, head.spec.hidden_size, device="cuda", generator=gen)
    ahead = AheadFeed(torch.randint(0, 100, (plan.num_tokens,), device="cuda", generator=gen),
                      torch.tensor([0, 3, 1], device="cuda"))
    args = (plan, features, steps, [1.0] * 3, torch.zeros(3, steps, dtype=torch.float64), [True] * 3, ahead)
    graphs = HeadRoundGraphs(head, pools[0], max_batch_size=4, sampling_batch_max=32)
    with torch.inference_mode():
        got = graphs(*args)
        want = EagerHeadRound(head, pools[1])(*args)
    assert graphs.replays == 1 and set(graphs.graphs) == {(4, 16, steps, True, True)}
    assert torch.equal(got[0], want[0])
    scratch = pools[0].scratch_row
    for cache in ("k_cache", "v_cache"):
        torch.testing.assert_close(getattr(pools[0], cache)[:, :scratch], getattr(pools[1], cache)[:, :scratch],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_tree_graphs_token_identical_to_eager(ckpt_a, gpu_heads, method, temperature):
    prompts = word_prompts(ckpt_a, 3)
    params = [SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=s) for s in range(3)]
    eager, _ = _outputs(ckpt_a, gpu_heads[method], method, False, prompts, params, spec_tree="2,2,1")
    graphed, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params, spec_tree="2,2,1")
    assert graphed == eager
    runner = llm.engine.runner
    assert runner.forward_fn.replays > 0  # the verification blocks replayed their graphs
    assert runner.speculation.proposer.round_fn.graphs == {}  # no chain rounds captured for a tree
    assert runner.stats.drafts > 0


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_through_compiled_kernels_matches_eager(ckpt_a, gpu_heads, method, rows):
    target = load_model(str(ckpt_a), dtype="bfloat16", device="cuda")[0]
    head = load_eagle_head(str(gpu_heads[method]), method, target)
    fused = head.compiled.get()  # the head's own bundle, as the engine gives it
    gen = torch.Generator(device="cuda").manual_seed(rows)
    ids = torch.randint(0, target.config.vocab_size, (rows, 1), device="cuda", generator=gen)
    positions = torch.randint(0, 100, (rows, 1), device="cuda", generator=gen)
    width = target.config.hidden_size * (1 if method == "eagle" else 3)
    captured = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
    outs = []
    with torch.no_grad():
        for kernels in (fused, EAGER):
            features = head.combine(captured, kernels)[:, None]  # [rows, 1, H]
            x = head(ids, features, positions, NoCacheView(), kernels)
            outs.append((features, x, head.logits(x[:, 0], kernels)))
    for got, want in zip(*outs, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        torch.testing.assert_close(got[finite], want[finite], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_rounds_run_their_fused_bundle(ckpt_a, gpu_heads, method):
    prompts = word_prompts(ckpt_a, 3)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    eager, eager_llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params)
    fused, llm = _outputs(ckpt_a, gpu_heads[method], method, True, prompts, params, compile_kernels=True)
    runner = llm.engine.runner
    proposer = runner.speculation.proposer
    assert proposer.round_fn.kernels.name == "fused" and proposer.round_fn.kernels is not runner.kernels
    assert eager_llm.engine.runner.speculation.proposer.round_fn.kernels is EAGER
    assert proposer.round_fn.replays > 0
    assert fused == eager  # float32: every projection on the library route, the rotary + KV write bit-identical
    assert runner.stats.accepted_tokens == eager_llm.engine.runner.stats.accepted_tokens
