"""GPU engine tests (run on the GPU machine: `pytest -m gpu tests/gpu`).

CUDA-graph replay must give the same tokens as eager execution: plain decode, draft steps
and speculative verification, both backends, batch 1 and a batch that pads to a bucket.
Compiled (fused) kernels must match the eager kernels within float tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.checkpoints import encode
from helpers.overlap import abort_in_flight, overlap_parity, overlap_prompts
from infer import LLM, SamplingParams
from infer.models.kernels import EAGER, compiled_kernels

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(model_dir, n=6):
    rng = random.Random(5)
    words = "the cat sat on the mat and a dog ran to the park while birds sang".split()
    return [encode(model_dir, " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))) for _ in range(n)]


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]


def test_adaptive_speculation_measures_its_costs_and_prepares_its_rounds(ckpt_a):
    # on a GPU the adaptive policy's c and verification slope are measured once at start
    # through the engine's own graphs; the whole-round graphs of K and of one-token probes
    # (buckets 1..4, step-1 widths 1, 2 and 4, greedy or not) exist before the first request
    kw = dict(device="cuda", dtype="float32", max_batch_size=4, max_seq_len=128, compile_kernels=False,
              use_cuda_graphs=True)
    llm = LLM(str(ckpt_a), use_speculative_decoding=True, draft_model=str(ckpt_a), spec_length=3,
              spec_policy="adaptive", **kw)
    policy, step = llm.engine.runner.speculation.policy, llm.engine.runner.speculation.draft.step_forward
    assert 0.2 < policy.config.c < 5.0 and policy.config.verify_slope >= 0.0  # a model drafting for itself
    assert set(step.loops) == {(b, w, k, g) for b in (1, 2, 4) for w in (1, 2, 4) for k in (1, 3)
                               for g in (True, False)}
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
        kw.update(use_speculative_decoding=True, draft_model=str(ckpt_a), spec_length=3)
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)
    widths = []
    if spec:  # record the widths the draft's graphs replay (catch-up chunks among them)
        step = graphs.engine.runner.speculation.draft.step_forward
        started_with = set(step.loops)
        replay = step._replay
        step._replay = lambda g, ids, layout: (widths.append(layout.width), replay(g, ids, layout))[1]
    for batch in ([prompts[0]], prompts):  # batch 1, and 6 rows padded to the bucket of 8
        assert _tokens(graphs, batch) == _tokens(eager, batch)
    forward = graphs.engine.runner.forward
    assert forward.replays > 0, "graphs were never replayed"
    if spec:
        from infer.speculative.draft_model import CATCH_UP_CHUNK
        assert CATCH_UP_CHUNK in widths  # the lazy draft prefill ran as padded graph replays
        assert forward.verify_replays > 0  # greedy acceptance ran in its graph
        draft_step = graphs.engine.runner.speculation.draft.step_forward
        assert draft_step.loop_replays > 0  # whole rounds in one replay
        # the whole-round graphs of the fixed policy were captured at start-up: buckets 1..8,
        # step-1 widths 1, 2 and 4, K = 3, greedy or not (only rounds the overflow guard
        # shortened near max_tokens were captured later)
        assert started_with == {(b, w, 3, g) for b in (1, 2, 4, 8) for w in (1, 2, 4) for g in (True, False)}
        assert all(k < 3 for b, w, k, g in set(draft_step.loops) - started_with)
        # the target drafting for itself accepts everything only if those replays filled the
        # draft cache with exactly the prompt
        assert graphs.engine.runner.stats.acceptance_rate >= 0.99
    assert graphs.engine.leak_report() == [] and eager.engine.leak_report() == []


def test_compiled_kernels_match_eager():
    from infer.models.linear import make_linear
    torch.manual_seed(0)
    k = compiled_kernels()
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(k.rmsnorm(x, w, 1e-5), EAGER.rmsnorm(x, w, 1e-5), atol=2e-2, rtol=2e-2)
    # the compiled rotary at long positions
    from infer.models.kernels import cos_sin
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
    from infer.cache.view import ViewIndices
    from infer.models.attention import masked_attention
    from infer.models.triton_attention import paged_decode_attention
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
    idx = ViewIndices(torch.empty(0, dtype=torch.long), gather, q_pos, ends)
    got = paged_decode_attention(q, kc, vc, gather, q_pos, ends)
    want = masked_attention(q, kc[gather], vc[gather], idx.mask())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("b, t", [(256, 1), (32, 8), (4, 1)])  # one chunk a program, one, several
def test_triton_chunk_attention_at_large_batches_matches_masked_sdpa(b, t):
    from infer.cache.view import ViewIndices
    from infer.models.attention import masked_attention
    from infer.models.triton_attention import TARGET_PROGRAMS, paged_decode_attention, split_plan
    torch.manual_seed(0)
    hkv, group, d, rows, s = 8, 3, 128, 4096, 600
    kc = torch.randn(rows + 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(b, t, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    ends = torch.randint(t + 1, s + 1, (b,), device="cuda")
    gather = torch.stack([torch.randperm(rows, device="cuda")[:s] for _ in range(b)])
    q_pos = ends[:, None] - t + torch.arange(t, device="cuda")[None, :]
    idx = ViewIndices(torch.empty(0, dtype=torch.long), gather, q_pos, ends)
    assert (split_plan(s, b * hkv * t)[1] == 1) == (b * hkv * t >= TARGET_PROGRAMS)
    got = paged_decode_attention(q, kc, vc, gather, q_pos, ends)
    want = masked_attention(q, kc[gather], vc[gather], idx.mask())
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("graphs", [False, True])
def test_triton_path_engine_matches_transformers(ckpt_c, graphs):
    # variant c has head_dim 32: the Triton attention path serves decode and verification
    from helpers.checkpoints import hf_greedy, load_hf_model
    prompts = _prompts(ckpt_c, 3)
    hf = load_hf_model(ckpt_c, dtype=torch.float32, device="cuda")
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    for spec in (False, True):
        kw = dict(use_speculative_decoding=True, draft_model=str(ckpt_c), spec_length=3) if spec else {}
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
    # the draft loop queues steps without waiting for the GPU: each step's staged inputs must
    # reach the GPU intact even when the host runs far ahead (a long matmul holds the stream)
    from infer.engine.executor.forward import EagerForward
    from infer.cache.view import BatchLayout
    from infer.engine.executor.graphs import GraphForward
    llm = LLM(str(ckpt_a), device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=2,
              max_seq_len=128, use_cuda_graphs=False, compile_kernels=False)
    runner = llm.engine.runner
    model, pool = runner.model, runner.cache_pool
    graphs = GraphForward(model, pool, [1, 2], [(1, False)])
    eager = EagerForward(model, pool)
    slots = [pool.allocate_slot(40), pool.allocate_slot(40)]
    start = [7, 19]
    prompt = torch.randint(0, model.config.vocab_size, (2, 19))
    with torch.inference_mode():
        for s in slots:
            pool.ensure_capacity(s, 40)
        eager(prompt, BatchLayout.of(slots, [0, 0], start), all_logits=False)  # rows of 7 and 19 tokens

        def run(forward, hold_stream):
            if hold_stream:
                big = torch.randn(4096, 4096, device="cuda")
                for _ in range(30):
                    big = big @ big / 64.0
            ids = torch.tensor([[3], [5]])
            outs = []
            for step in range(8):
                layout = BatchLayout.of(slots, [start[0] + step, start[1] + step], [1, 1])
                logits = forward(ids, layout, all_logits=False)  # [2, V]
                outs.append(logits.clone())
                ids = logits.argmax(dim=-1)[:, None]  # stays on the device
            for s, n in zip(slots, start):
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


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
@pytest.mark.parametrize("width", [1, 3])
def test_draft_loop_graph_matches_eager(ckpt_a, backend, width):
    # a whole draft round in one replay: the same tokens, probabilities and cache contents as
    # the eager step-by-step loop; three rows padded to the bucket of 4, greedy and sampled
    from infer.engine.executor.forward import EagerForward
    from infer.cache.view import BatchLayout
    from infer.engine.executor.graphs import GraphForward
    llm = LLM(str(ckpt_a), device="cuda", dtype="float32", kv_cache_backend=backend, max_batch_size=4,
              max_seq_len=128, use_cuda_graphs=False, compile_kernels=False)
    runner = llm.engine.runner
    model, pool = runner.model, runner.cache_pool
    graphs = GraphForward(model, pool, [1, 2, 4], [(w, False) for w in range(1, 5)])
    eager = EagerForward(model, pool)
    steps, start = 4, [7, 19, 12]
    slots = [pool.allocate_slot(40) for _ in start]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (3, 19), generator=gen)
    feed = torch.randint(0, model.config.vocab_size, (3, width), generator=gen)
    uniforms = torch.rand((3, steps), generator=gen, dtype=torch.float64)
    temperatures, greedy = [0.7, 1.0, 1.0], [False, False, True]
    layout = BatchLayout.of(slots, start, [width + steps - 1] * 3)
    with torch.inference_mode():
        for s in slots:
            pool.ensure_capacity(s, 40)
        eager(prompt, BatchLayout.of(slots, [0, 0, 0], start), all_logits=False)

        def run(forward, greedy=greedy):
            for s in slots:  # (paged truncation below gives the blocks past the start back)
                pool.ensure_capacity(s, 40)
            tokens, probs = forward.draft_loop(feed, layout, steps, temperatures, uniforms, greedy)
            if probs is None:
                probs = torch.zeros(0)
            assert [pool.seq_len(s) for s in slots] == layout.ends
            kv = torch.cat([pool.k_cache[:, pool.rows(s, 0, e).to("cuda")]  # what the round wrote, and before
                            for s, e in zip(slots, layout.ends, strict=True)], dim=1)
            out = tokens.clone(), probs.clone(), kv
            for s, n in zip(slots, start, strict=True):
                pool.truncate_to(s, n)
            return out

        reference = run(eager)
        replayed = run(graphs)
        again = run(graphs)  # the captured graph replayed
        greedy_reference = run(eager, [True] * 3)  # every row greedy: argmax, no probabilities
        greedy_replayed = run(graphs, [True] * 3)
    assert graphs.loop_replays == 3 and len(graphs.loops) == 2
    assert greedy_replayed[0].tolist() == greedy_reference[0].tolist()
    assert greedy_replayed[1].numel() == greedy_reference[1].numel() == 0
    torch.testing.assert_close(greedy_replayed[2], greedy_reference[2], rtol=1e-4, atol=1e-4)
    assert replayed[0].tolist() == reference[0].tolist() == again[0].tolist()
    torch.testing.assert_close(replayed[1], reference[1], rtol=1e-4, atol=1e-5)
    assert (replayed[1][2].max(dim=-1).values == 1).all()  # the greedy row: one-hot
    torch.testing.assert_close(replayed[2], reference[2], rtol=1e-4, atol=1e-4)
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
    # draft steps at T > 0 sample inside their CUDA graph, and verification's rejection
    # sampling runs in a graph too: seeded outputs must equal eager's
    kw = dict(draft_model=str(ckpt_a)) if method == "draft_model" else dict(speculative_method="ngram")
    graphs = _sampled_graphs_match_eager(ckpt_a, kv_cache_backend=backend, use_speculative_decoding=True,
                                         spec_length=3, **kw)
    runner = graphs.engine.runner
    if method == "draft_model":  # the target drafting for itself: most drafts accepted
        step = runner.speculation.draft.step_forward
        assert step.loop_replays > 0 and runner.stats.accepted_tokens > 0
    assert runner.forward.verify_replays > 0


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_sampled_plain_decode_in_graphs_matches_eager(ckpt_a, backend):
    # plain decode steps at T > 0 sample inside their CUDA graph: seeded outputs equal eager's
    graphs = _sampled_graphs_match_eager(ckpt_a, kv_cache_backend=backend)
    assert graphs.engine.runner.forward.sample_replays > 0


@pytest.mark.parametrize("cap", [16, None])
@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_sampled_batches_above_the_sampling_graphs_replay_the_forward_graphs(ckpt_a, spec, cap, monkeypatch):
    # buckets above `cuda_graph_sampling_batch_max` (cap 16) have no sampling, acceptance or
    # draft-loop graphs: their steps replay the forward's graph and finish eagerly on the
    # device (an eager forward at batch 32 cost ~6x a replayed one on the H100), with the
    # same seeded tokens as eager. Under the default cap (32) a batch of 20 has them all:
    # nothing finishes eagerly, and the tokens are the same
    import infer.engine.executor.graphs as cuda_graphs
    batch = 20
    prompts = _prompts(ckpt_a, n=batch)
    params = [SamplingParams(temperature=[0.8, 1.0, 0.0, 1.5][i % 4], max_tokens=16, ignore_eos=True, seed=7 + i)
              for i in range(batch)]
    kw = dict(device="cuda", dtype="float32", max_batch_size=32, max_seq_len=128, compile_kernels=False)
    if cap is not None:
        kw["cuda_graph_sampling_batch_max"] = cap
    if spec is not None:
        kw.update(use_speculative_decoding=True, spec_length=3,
                  **(dict(draft_model=str(ckpt_a)) if spec == "draft_model" else dict(speculative_method="ngram")))
    eager = LLM(str(ckpt_a), use_cuda_graphs=False, **kw)
    graphs = LLM(str(ckpt_a), use_cuda_graphs=True, **kw)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]

    runner = graphs.engine.runner
    forwards = [runner.forward] + ([runner.speculation.draft.step_forward] if spec == "draft_model" else [])
    whole_eager_steps, bucket_replays, finished_eagerly = [], [], []
    for f in forwards:  # a decode step run whole eagerly (prefill chunks are eager anyway)
        for name in ("sample", "verify", "draft_loop"):
            inner = getattr(f.eager, name)
            setattr(f.eager, name, lambda *a, _inner=inner, _name=name: (whole_eager_steps.append(_name), _inner(*a))[1])
        replay = f._replay
        f._replay = lambda g, ids, layout, _replay=replay: (bucket_replays.append(len(layout.slots)), _replay(g, ids, layout))[1]
    for name in ("sample_logits", "verify_on_logits", "draft_steps"):  # a graph's output finished eagerly
        inner = getattr(cuda_graphs, name)
        monkeypatch.setattr(cuda_graphs, name,
                            lambda *a, _inner=inner, _name=name: (finished_eagerly.append(_name), _inner(*a))[1])
    assert run(graphs) == run(eager)
    assert whole_eager_steps == []
    assert max(bucket_replays) > 16  # the big batch replayed graphs of its own bucket
    if cap is None:
        assert finished_eagerly == []
    else:
        assert "sample_logits" in finished_eagerly or "verify_on_logits" in finished_eagerly
    assert graphs.engine.leak_report() == []


def test_fp8_model_fused_kernels_match_eager_logits(ckpt_a):
    # FP8 weights through the Triton matmul with its epilogues fused (the decode paths'
    # kernels) against the eager FP8 model: the same logits up to bf16 rounding
    from infer.cache.factory import make_cache_pool
    from infer.cache.view import BatchLayout
    from infer.models.loader import load_model
    model, config = load_model(str(ckpt_a), dtype="bfloat16", device="cuda", quantization="fp8")
    ids = torch.randint(0, config.vocab_size, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    outs = []
    for bundle in (EAGER, compiled_kernels()):
        pool = make_cache_pool("paged", config, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16,
                               device=torch.device("cuda"), block_size=4, enable_prefix_caching=False)
        slots = [pool.allocate_slot(6) for _ in range(2)]
        layout = BatchLayout.of(slots, [0, 0], [6, 6])
        with torch.no_grad():
            outs.append(model(ids, layout.positions("cuda"), pool.view(layout), kernels=bundle).float())
    scale = outs[0].abs().max()
    assert (outs[1] - outs[0]).abs().max() <= 0.03 * scale


def test_fp8_engine_with_graphs_drafts_for_itself(ckpt_a):
    # an FP8 target drafting for itself through graphs and fused kernels: every draft accepted
    prompts = _prompts(ckpt_a)
    llm = LLM(str(ckpt_a), device="cuda", dtype="bfloat16", max_batch_size=8, max_seq_len=128, quantization="fp8",
              use_cuda_graphs=True, use_speculative_decoding=True, draft_model=str(ckpt_a), spec_length=3,
              draft_quantization="fp8")
    _tokens(llm, prompts)
    assert llm.engine.runner.forward.replays > 0 and llm.engine.runner.stats.acceptance_rate >= 0.95
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
    # the same model gives the same greedy tokens, so every draft is accepted (the open
    # fused-path disagreement of docs/benchmarks.md fails this)
    from infer.engine.loading import DEMO_TARGET
    llm = LLM(str(DEMO_TARGET), device="cuda", max_batch_size=4, max_seq_len=512, use_cuda_graphs=True,
              quantization=quantization, use_speculative_decoding=True, spec_length=5,
              draft_model=str(DEMO_TARGET), draft_quantization=quantization)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "for i in range(10):"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    assert llm.engine.runner.stats.acceptance_rate >= 0.98 and llm.engine.leak_report() == []
