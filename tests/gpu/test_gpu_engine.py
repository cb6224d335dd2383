"""GPU engine tests (run on the GPU machine: `pytest -m gpu tests/gpu`).

CUDA-graph replay must give the same tokens as eager execution: plain decode, draft steps
and speculative verification, both backends, batch 1 and a batch that pads to a bucket.
Compiled (fused) kernels must match the eager kernels within float tolerance; the flat
batch's attention kernels match the gathered reference at scale.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.checkpoints import encode
from helpers.overlap import abort_in_flight, overlap_parity, overlap_prompts
from helpers.padded_attention import padded_split_attention
from infer import LLM, SamplingParams
from infer.models.kernels.bundle import EAGER, compiled_kernels

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(model_dir, n=6):
    rng = random.Random(5)
    words = "the cat sat on the mat and a dog ran to the park while birds sang".split()
    return [encode(model_dir, " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))) for _ in range(n)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_adaptive_speculation_measures_its_costs(ckpt_a):
    # on a GPU the adaptive policy's c and verification slope are measured once at start
    # through the engine's own graphs
    kw = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128, compile_kernels=False,
              use_cuda_graphs=True)
    llm = LLM(str(ckpt_a), use_speculative_decoding=True, spec_batch_gate=False, draft_model=str(ckpt_a),
              spec_length=3, spec_policy="adaptive", **kw)
    policy = llm.engine.runner.speculation.policy
    assert 0.2 < policy.config.c < 5.0 and policy.config.verify_slope >= 0.0  # a model drafting for itself
    prompts = _prompts(ckpt_a, 4)
    plain = LLM(str(ckpt_a), **kw)
    assert _tokens(llm, prompts) == _tokens(plain, prompts)
    assert llm.engine.leak_report() == [] and llm.engine.runner.cache_pool.leak_report() == []
    assert plain.engine.leak_report() == []


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("spec", [False, True])
def test_cuda_graphs_token_identical_to_eager(ckpt_a, backend, spec):
    prompts = _prompts(ckpt_a)
    kw = dict(device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=8, max_seq_len=128,
              compile_kernels=False)
    if spec:
        kw.update(use_speculative_decoding=True, spec_batch_gate=False, draft_model=str(ckpt_a), spec_length=3)
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    for batch in ([prompts[0]], prompts):  # batch 1, and 6 rows padded to the bucket of 8
        assert _tokens(graphs, batch) == _tokens(eager, batch)
    assert graphs.engine.runner.forward_fn.replays > 0, "graphs were never replayed"
    if spec:
        assert graphs.engine.runner.speculation.draft.step_forward.replays > 0  # the draft's steps too
        # the target drafting for itself accepts everything only if the draft's passes filled
        # its cache with exactly the prompt
        assert graphs.engine.runner.stats.acceptance_rate >= 0.99
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []


def test_compiled_kernels_match_eager():
    from infer.models.layers.linear import make_linear
    torch.manual_seed(0)
    k = compiled_kernels()
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(k.rmsnorm(x, w, 1e-5), EAGER.rmsnorm(x, w, 1e-5), atol=2e-2, rtol=2e-2)
    # the compiled rotary at long positions
    from infer.models.layers.rotary import cos_sin
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    positions = torch.arange(0, 4000, 7, device="cuda")[None, :].expand(2, -1)
    cos, sin = cos_sin(positions, inv_freq, torch.bfloat16)
    q = torch.randn(2, positions.shape[1], 8, 64, device="cuda", dtype=torch.bfloat16)
    kk = torch.randn(2, positions.shape[1], 2, 64, device="cuda", dtype=torch.bfloat16)
    for got, want in zip(k.rotary_qk(q, kk, cos, sin), EAGER.rotary_qk(q, kk, cos, sin), strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    # the Triton matmul (rows <= 16; split-K where the output is narrow) and its epilogues
    for quantization in (None, "fp8"):
        for rows, n, kdim in [(1, 3072, 512), (5, 128, 3072), (16, 4096, 1024)]:
            layer = make_linear(kdim, 2 * n, quantization).cuda().bfloat16()  # FP8 storage stays FP8
            layer.load_rows(torch.randn(2 * n, kdim, device="cuda") * 0.05, None)
            xs = torch.randn(rows, kdim, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16)
            dense = layer.dense_weight(torch.bfloat16)
            ref = (xs.float() @ dense.float().t()).bfloat16()
            torch.testing.assert_close(k.linear(layer, xs, None), ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(k.linear(layer, xs, res), (ref.float() + res.float()).bfloat16(),
                                       atol=3e-2, rtol=2e-2)
            gate, up = ref.chunk(2, -1)
            want = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
            torch.testing.assert_close(k.swiglu(layer, xs), want, atol=3e-2, rtol=3e-2)
            if quantization == "fp8":  # the layer's own forward (any rows) on the GPU: the same function
                wide = torch.randn(40, kdim, device="cuda", dtype=torch.bfloat16)
                torch.testing.assert_close(layer(wide), (wide.float() @ dense.float().t()).bfloat16(),
                                           atol=3e-2, rtol=3e-2)


def test_graphs_with_compiled_kernels_match_transformers_greedy(ckpt_a):
    from helpers.checkpoints import hf_greedy, load_hf_model
    prompts = _prompts(ckpt_a, 3)
    hf = load_hf_model(ckpt_a, dtype=torch.float32, device="cuda")
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(str(ckpt_a), device="cuda", dtype="float32", use_cuda_graphs=True, compile_kernels=True,
              max_batch_size=4, max_seq_len=128)
    for got, ref in zip(_tokens(llm, prompts), refs, strict=True):
        assert got[:len(ref)] == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, group, d", [(1, 3, 128), (6, 4, 64), (1, 1, 16), (3, 8, 64), (100, 3, 64)])
def test_triton_chunk_attention_matches_masked_sdpa(dtype, t, group, d):
    from infer.models.layers.attention import masked_attention, position_mask
    torch.manual_seed(0)
    b, hkv, rows, s = 3, 2, 500, 300
    kc = torch.randn(rows + 1, hkv, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(b, t, hkv * group, d, device="cuda", dtype=dtype)
    first = max(7, t + 1)
    ends = torch.tensor([first, 130, 300], device="cuda")  # every query sees >= 1 key
    gather = torch.stack([torch.randperm(rows, device="cuda")[:s] for _ in range(b)])
    gather[0, first:] = rows  # padding -> scratch row
    q_pos = ends[:, None] - t + torch.arange(t, device="cuda")[None, :]
    got = padded_split_attention(q, kc, vc, gather, q_pos, ends)
    want = masked_attention(q, kc[gather], vc[gather], position_mask(q_pos, ends, s))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("b, t", [(256, 1), (32, 8), (4, 1)])  # one chunk a program, one, several
def test_triton_chunk_attention_at_large_batches_matches_masked_sdpa(b, t):
    from infer.models.kernels.split_attention import TARGET_PROGRAMS, split_plan
    from infer.models.layers.attention import masked_attention, position_mask
    torch.manual_seed(0)
    hkv, group, d, rows, s = 8, 3, 128, 4096, 600
    kc = torch.randn(rows + 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, t, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ends = torch.randint(t + 1, s + 1, (b,), device="cuda")
    gather = torch.stack([torch.randperm(rows, device="cuda")[:s] for _ in range(b)])
    q_pos = ends[:, None] - t + torch.arange(t, device="cuda")[None, :]
    assert (split_plan(s, b * hkv * t)[1] == 1) == (b * hkv * t >= TARGET_PROGRAMS)
    got = padded_split_attention(q, kc, vc, gather, q_pos, ends)
    want = masked_attention(q, kc[gather], vc[gather], position_mask(q_pos, ends, s))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tree", [False, True])
def test_flat_attention_kernels_match_the_reference_at_scale(tree):
    # a flat batch over a paged pool of 16-position blocks: decode rows, verification blocks
    # (a tree's rule), a prefill chunk after cached context; the split-KV and prefill kernels
    # against the gathered masked SDPA, bf16
    from infer.cache.block_tables import BlockTables
    from infer.cache.forward_batch import Row, RowTree, build_batch, plan_batch
    from infer.models.kernels.arrivals import ArrivalCounters
    from infer.models.layers.paged_attention import BatchView, reference_attention
    torch.manual_seed(0)
    hkv, group, d, blocks, bs = 8, 3, 128, 2048, 16
    kc = torch.randn(blocks * bs + 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = BlockTables(64, 128, "cuda")
    order = torch.randperm(blocks).tolist()
    for slot in range(64):
        tables.set(slot, 0, order[slot * 32:(slot + 1) * 32])
    rule = RowTree([1, 3, 5, 11, 21], [0, 1, 1, 2, 2], 0, 5) if tree else None
    rows = [Row(s, 100 + 7 * s, [1], logits=1) for s in range(40)]
    rows += [Row(40 + s, 300 + s, [2] * (5 if tree else 4), logits=4, tree=rule) for s in range(8)]
    if not tree:
        rows.append(Row(60, 120, [3] * 300))
    batch = build_batch(plan_batch(rows), tables, bs, blocks * bs, "cuda")
    q = torch.randn(batch.num_tokens, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    got = BatchView(kc[None], vc[None], batch, ArrivalCounters(kc.device)).attend_written(q, kc, vc)
    want = reference_attention(q, kc, vc, batch)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("graphs", [False, True])
def test_triton_path_engine_matches_transformers(ckpt_c, graphs):
    # variant c has head_dim 32: the Triton attention path serves decode and verification
    from helpers.checkpoints import hf_greedy, load_hf_model
    prompts = _prompts(ckpt_c, 3)
    hf = load_hf_model(ckpt_c, dtype=torch.float32, device="cuda")
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    for spec in (False, True):
        kw = dict(use_speculative_decoding=True, spec_batch_gate=False, draft_model=str(ckpt_c),
                  spec_length=3) if spec else {}
        llm = LLM(str(ckpt_c), device="cuda", dtype="float32", use_cuda_graphs=graphs, compile_kernels=False,
                  max_batch_size=4, max_seq_len=128, **kw)
        for got, ref in zip(_tokens(llm, prompts), refs, strict=True):
            assert got[:len(ref)] == ref


def test_pinned_async_copies_arrive_intact_behind_queued_work():
    # the copy is queued behind a long GPU computation and its host tensor is dropped at once:
    # the values must still arrive (the pinned staging buffer outlives the copy)
    from infer.transfer import tensor_on, to_device
    big = torch.randn(4096, 4096, device="cuda")
    outs = []
    for i in range(50):
        big = big @ big / 64.0  # keeps the stream busy
        outs.append(tensor_on(list(range(i, i + 100)), "cuda"))
        outs.append(to_device(torch.full((3,), float(i), dtype=torch.float64), "cuda"))
    torch.cuda.synchronize()
    for i in range(50):
        assert outs[2 * i].tolist() == list(range(i, i + 100))
        assert outs[2 * i + 1].tolist() == [float(i)] * 3


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_graph_steps_queued_back_to_back_match_eager(ckpt_a, backend):
    # steps queued without waiting for the GPU, each feeding the ids the one before chose on
    # the device: each step's staged inputs must reach the GPU intact even when the host runs
    # far ahead (a long matmul holds the stream)
    from infer.cache.forward_batch import DeviceIds, Row, plan_batch
    from infer.engine.executor.batch_forward import EagerBatchForward, GraphBatchForward
    llm = LLM(str(ckpt_a), device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=2,
              max_seq_len=128, use_cuda_graphs=False, compile_kernels=False)
    runner = llm.engine.runner
    model, pool = runner.model, runner.cache_pool
    graphs = GraphBatchForward(model, pool, [1, 2], 2, 128)
    eager = EagerBatchForward(model, pool)
    slots = [pool.allocate_slot(40), pool.allocate_slot(40)]
    start = [7, 19]
    prompt = torch.randint(0, model.config.vocab_size, (2, 19)).tolist()
    with torch.inference_mode():
        for s in slots:
            pool.ensure_capacity(s, 40)
        eager.run(plan_batch([Row(s, 0, p[:n]) for s, p, n in zip(slots, prompt, start, strict=True)]))

        def run(forward, hold_stream):
            if hold_stream:
                big = torch.randn(4096, 4096, device="cuda")
                for _ in range(30):
                    big = big @ big / 64.0
            ids, outs = None, []
            for step in range(8):
                plan = plan_batch([Row(s, n + step, [3 + i]) for i, (s, n) in enumerate(zip(slots, start, strict=True))])
                logits = forward.run(plan, None if ids is None else DeviceIds((0, 1), ids))  # [2, V]
                outs.append(logits.clone())
                ids = logits.argmax(dim=-1)  # stays on the device
            for s, n in zip(slots, start, strict=True):
                pool.truncate_to(s, n)
            torch.cuda.synchronize()
            return torch.stack(outs)

        reference = run(eager, hold_stream=False)
        replayed = run(graphs, hold_stream=True)
    assert graphs.replays == 8
    torch.testing.assert_close(replayed, reference, rtol=1e-4, atol=1e-4)
    for s in slots:
        pool.free_slot(s)
    assert llm.engine.leak_report() == []


def _sampled_graphs_match_eager(ckpt, **engine_kwargs):
    """Seeded mixed-temperature batches of 1, 2 and 6 rows (buckets 1, 2 and 8, padded) give
    the same tokens with CUDA graphs as eagerly; returns the graphs engine's LLM."""
    prompts = _prompts(ckpt)
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=3 + i)
              for i, t in enumerate([0.8, 1.0, 0.0, 1.5, 1.0, 0.6])]
    kw = dict(device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128, compile_kernels=False,
              **engine_kwargs)
    eager = LLM(str(ckpt), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt), use_cuda_graphs=True, **kw)

    def run(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts[:batch],
                                                             sampling_params=params[:batch])]

    for batch in (1, 2, 6):
        assert run(graphs, batch) == run(eager, batch)
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []
    return graphs


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_speculation_with_graphs_matches_eager(ckpt_a, backend, method):
    # verification blocks and draft steps replay their graphs: seeded outputs equal eager's
    kw = dict(draft_model=str(ckpt_a)) if method == "draft_model" else dict(speculative_method="ngram")
    graphs = _sampled_graphs_match_eager(ckpt_a, kv_cache_backend=backend, use_speculative_decoding=True,
                                         spec_batch_gate=False, spec_length=3, **kw)
    runner = graphs.engine.runner
    if method == "draft_model":  # the target drafting for itself: most drafts accepted
        assert runner.speculation.draft.step_forward.replays > 0 and runner.stats.accepted_tokens > 0
    assert runner.forward_fn.replays > 0


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_sampled_plain_decode_in_graphs_matches_eager(ckpt_a, backend):
    # plain decode steps at T > 0 replay their graphs: seeded outputs equal eager's
    graphs = _sampled_graphs_match_eager(ckpt_a, kv_cache_backend=backend)
    assert graphs.engine.runner.forward_fn.replays > 0


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_a_batch_of_twenty_replays_its_own_bucket(ckpt_a, spec):
    # 20 rows (decode steps of 20 tokens, rounds of up to 80) replay graphs of their token
    # buckets, with the same seeded tokens as eager
    batch = 20
    prompts = _prompts(ckpt_a, n=batch)
    params = [SamplingParams(temperature=[0.8, 1.0, 0.0, 1.5][i % 4], max_tokens=16, ignore_eos=True, seed=7 + i)
              for i in range(batch)]
    kw = dict(device="cuda", dtype="float32", max_batch_size=32, max_seq_len=128, compile_kernels=False)
    if spec is not None:
        kw.update(use_speculative_decoding=True, spec_batch_gate=False, spec_length=3,
                  **(dict(draft_model=str(ckpt_a)) if spec == "draft_model" else dict(speculative_method="ngram")))
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]

    runner = graphs.engine.runner
    fn, forward, buckets = runner.forward_fn, runner.forward, []
    runner.forward = lambda plan, ids=None: (buckets.append(plan.num_tokens if fn.serves(plan) else 0),
                                             forward(plan, ids))[1]
    assert run(graphs) == run(eager)
    assert max(buckets) >= batch  # the big batch replayed graphs of its own bucket
    assert graphs.engine.leak_report() == []


def test_fp8_model_fused_kernels_match_eager_logits(ckpt_a):
    # FP8 weights through the Triton matmul with its epilogues fused (the decode paths'
    # kernels) against the eager FP8 model: the same logits up to bf16 rounding
    from infer.cache.factory import make_cache_pool
    from infer.cache.forward_batch import Row, build_batch, plan_batch
    from infer.engine.executor.batch_forward import run_model
    from infer.models.loading.loader import load_model
    model, config = load_model(str(ckpt_a), dtype="bfloat16", device="cuda", quantization="fp8")
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).tolist()
    outs = []
    for bundle in (EAGER, compiled_kernels()):
        pool = make_cache_pool("paged", config, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16,
                               device=torch.device("cuda"), block_size=4, enable_prefix_caching=False)
        slots = [pool.allocate_slot(6) for _ in range(2)]
        batch = build_batch(plan_batch([Row(s, 0, row, logits=6) for s, row in zip(slots, ids, strict=True)]),
                            pool.tables, pool.block_size, pool.scratch_row, "cuda")
        with torch.no_grad():
            outs.append(model.logits(run_model(model, pool, batch, bundle), bundle).float())
    scale = outs[0].abs().max()
    assert (outs[1] - outs[0]).abs().max() <= 0.03 * scale


def test_fp8_engine_with_graphs_drafts_for_itself(ckpt_a):
    # an FP8 target drafting for itself through graphs and fused kernels: every draft accepted
    prompts = _prompts(ckpt_a)
    llm = LLM(str(ckpt_a), device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=128, quantization="fp8",
              use_cuda_graphs=True, use_speculative_decoding=True, spec_batch_gate=False, draft_model=str(ckpt_a),
              spec_length=3, draft_quantization="fp8")
    _tokens(llm, prompts)
    assert llm.engine.runner.forward_fn.replays > 0 and llm.engine.runner.stats.acceptance_rate >= 0.95
    assert llm.engine.leak_report() == []


OVERLAP_GPU = dict(device="cuda", dtype="float32", use_cuda_graphs=True, compile_kernels=False)


@pytest.mark.parametrize("config", ["plain", "ngram", "draft", "adaptive", "preempt"])
def test_overlapped_scheduling_matches_synchronous_on_the_gpu(make_llm, ckpt_a, config):
    # graphs, device-resident tokens feeding the next step: the CPU suite's scenario (greedy,
    # seeded sampling, a stop id mid-run, a stop string, max_tokens, top-p; speculation;
    # preemption) gives the same outputs as synchronous scheduling
    overlap_parity(make_llm, ckpt_a, overlap_prompts(ckpt_a), config, **OVERLAP_GPU)


def test_an_abort_with_a_step_in_flight_on_the_gpu_gives_everything_back(make_llm, ckpt_a):
    abort_in_flight(make_llm, ckpt_a, overlap_prompts(ckpt_a), **OVERLAP_GPU)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_model_drafting_for_itself_under_fused_kernels_accepts_everything(quantization):
    # the demo target in bf16 drafting for itself, graphs and fused kernels on both sides
    # (the draft's prompt KV written by its catch-up graphs, the target's by eager prefill):
    # the same model gives the same greedy tokens, so every draft is accepted (a fused
    # kernel that rounds a draft step and its verification differently fails this)
    from infer.engine.loading import DEMO_TARGET
    llm = LLM(str(DEMO_TARGET), device="cuda", max_batch_size=4, max_seq_len=512, use_cuda_graphs=True,
              quantization=quantization, use_speculative_decoding=True, spec_batch_gate=False, spec_length=5,
              draft_model=str(DEMO_TARGET), draft_quantization=quantization)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "for i in range(10):"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    assert llm.engine.runner.stats.acceptance_rate >= 0.98 and llm.engine.leak_report() == []


def test_device_block_tables_keep_each_entrys_last_change():
    # entries changed several times between two passes (a slot freed and taken again, a
    # prefix-cache swap): the device copy holds each one's last block, as the host's does (an
    # indexed assignment of repeated indices keeps any of them); a follower's copy on the
    # device (a tensor-parallel worker's) applies the same journal alike
    from infer.cache.block_tables import BlockTables
    tables = BlockTables(16, 64, "cuda")
    follower = BlockTables(16, 64, "cuda")
    follower.apply(tables.follow())
    for turn in range(8):
        for slot in range(16):
            tables.set(slot, 0, list(range(turn * 64, turn * 64 + 64)))
    follower.apply(tables.take_changes())
    want = torch.from_numpy(tables.host).cuda()
    assert torch.equal(tables.sync(), want) and torch.equal(follower.sync(), want)
