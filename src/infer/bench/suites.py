"""Predefined benchmark suites: which measurements, in which order, compared with what.

    w1-plain       W1 batch-1 decode, 3B and 1B shapes: roofline, ours with CUDA graphs
                   (with and without compiled kernel fusion) and eager, transformers generate
    spec-costs     c = 1B step / 3B step (graphs and eager), verification cost v(K),
                   projected speedup for alpha 0.6..0.9, K 1..8, and of static trees
    w1-spec-dummy  W1 on the 3B shape: drafted by the 1B shape (fixed K=5, adaptive),
                   drafted by itself (acceptance 1), against plain decoding
    w2             W2 continuous vs static batching (8 slots for 32 requests); W2-prefix with
                   and without prefix caching
    demo-pair      W1 on the bundled demo pair at T=0 and T=1: plain, speculative (fixed,
                   adaptive), trees against chains verifying as many tokens a round,
                   transformers plain and assisted generation
    w5-ngram       W5 code edit at T=0 and T=1: n-gram / prompt lookup / draft model vs
                   plain, n-gram trees against n-gram chains, transformers prompt lookup;
                   W1 with adaptive n-gram vs plain
                   (--model / --draft-model replace the demo pair in these two)
    decode-speed   W1 batch-1 decode of both shapes: overlapped and synchronous scheduling,
                   FP8 weights, against the roofline; decode step time against batch size
    costs-fp8      c and v(K) of the 1B draft for the 3B target, bf16 and FP8 draft;
                   projections
    speculation    3B with a random 1B draft (fixed, adaptive); demo pair T=0/1 (fixed,
                   adaptive, FP8 draft, chain K=6 vs tree 2,1,1); n-gram on W5 and W1 at T=0
                   (fixed, adaptive, prompt lookup; on W5 chain K=6 vs tree 2,1,1)
    tp             tensor parallelism on 2 GPUs: 8B shape W1 decode TP=2 (overlapped and
                   synchronous steps) vs TP=1 (paired); the 3B shape drafted by the 1B at
                   TP=2 (draft on the driver vs sharded) against plain TP=2; the collectives'
                   time per step (profile); W2 throughput TP=2 vs TP=1; lm_head / embedding
                   layouts
    all-gpu        the runs of record: decode-speed, costs-fp8, speculation, W2 continuous vs
                   static, HF static cache + compile; most important first, within --max-seconds
    smoke          every kind of measurement on one small model, CPU-friendly: --model and
                   --draft-model, by default the bundled demo pair

Dummy shapes have random weights: their acceptance rates mean nothing except at the
extremes (a random draft: near 0; the target drafting for itself: 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from infer.bench.harness import Harness
from infer.bench.peers import HFPeer
from infer.bench.workloads import WORKLOADS, Workload
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET
from infer.speculative.tree import TreeShape

SHAPE_3B, SHAPE_1B = "dummy:llama-3.2-3b", "dummy:llama-3.2-1b"
SHAPE_8B = "dummy:llama-3.1-8b"
SPEC_K = 5
# tree speculation (#37): (chain K, tree) pairs verifying as many tokens a round (K + 1 = N + 1)
TREE_PAIRS = ((6, "2,1,1"), (12, "3,1,1,1"))
GRAPHS = {"use_cuda_graphs": True}


def _label(model: str) -> str:
    return model.removeprefix("dummy:llama-3.2-").removeprefix("dummy:")


def w1_plain(h: Harness, shapes: tuple[str, ...] = (SHAPE_3B, SHAPE_1B)) -> None:
    for shape in shapes:
        w1_plain_shape(h, shape)


def w1_plain_shape(h: Harness, shape: str) -> None:
    label, wl = _label(shape), WORKLOADS["W1"]
    group = f"W1 plain decode, {label} shape"
    roof = h.roofline(shape, label).name
    base = h.engine(f"w1/{label}/ours", group, wl, {"model": shape, **GRAPHS}, {"roofline": roof}).name
    h.engine(f"w1/{label}/ours-eager", group, wl, {"model": shape}, {"roofline": roof, "baseline": base})
    h.engine(f"w1/{label}/ours-graphs-unfused", group, wl, {"model": shape, **GRAPHS, "compile_kernels": False},
             {"roofline": roof, "baseline": base})
    h.hf(f"w1/{label}/hf", group, wl, HFPeer(shape), {"roofline": roof, "baseline": base})


def spec_costs(h: Harness) -> None:
    for graphs in (True, False):
        h.spec_costs(f"costs/3b-1b/{'graphs' if graphs else 'eager'}", SHAPE_3B, SHAPE_1B, graphs)
    h.projection("projection/3b-1b", "costs/3b-1b/graphs")


def w1_spec_dummy(h: Harness) -> None:
    wl, group = WORKLOADS["W1"], "W1 speculative, 3b shape (dummy weights)"
    costs = h.spec_costs("costs/3b-1b/graphs", SHAPE_3B, SHAPE_1B, True).name
    self_costs = h.spec_costs("costs/3b-3b/graphs", SHAPE_3B, None, True, self_draft=True).name
    base = h.engine("w1-spec/3b/plain", group, wl, {"model": SHAPE_3B, **GRAPHS}).name
    spec = {"model": SHAPE_3B, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K}
    refs = {"baseline": base, "costs": costs}
    h.engine("w1-spec/3b/1b-draft-k5", group, wl, {**spec, "draft_model": SHAPE_1B}, refs)
    h.engine("w1-spec/3b/1b-draft-adaptive", group, wl, {**spec, "draft_model": SHAPE_1B, "spec_policy": "adaptive"},
             refs, paired_with={"model": SHAPE_3B, **GRAPHS})
    h.engine("w1-spec/3b/self-draft-k5", group, wl, {**spec, "draft_model": SHAPE_3B},
             {"baseline": base, "costs": self_costs})


def w2(h: Harness, shape: str = SHAPE_3B) -> None:
    label = _label(shape)
    w2_batching(h, shape)
    group = f"W2-prefix, {label} shape"
    base = h.engine(f"w2-prefix/{label}/prefix-cache", group, WORKLOADS["W2-prefix"],
                    {"model": shape, **GRAPHS, "enable_prefix_caching": True}).name
    h.engine(f"w2-prefix/{label}/no-prefix-cache", group, WORKLOADS["W2-prefix"],
             {"model": shape, **GRAPHS, "enable_prefix_caching": False}, {"baseline": base})


def demo_pair_paths(h: Harness) -> tuple[str, str]:
    """The bundled demo pair, or --model / --draft-model when given (e.g. real 3B/1B)."""
    return h.options.model or str(DEMO_TARGET), h.options.draft_model or str(DEMO_DRAFT)


def demo_models_present(h: Harness, suite: str) -> bool:
    """True when the pair exists; else one error measurement says what is missing."""
    if h.options.model is not None:
        return True  # the loader reports a bad path in the first measurement
    missing = [p for p in (DEMO_TARGET, DEMO_DRAFT) if not (p / "config.json").is_file()]
    if not missing:
        return True

    def fail() -> tuple[dict, dict]:
        raise FileNotFoundError(f"the bundled demo model(s) {[str(p) for p in missing]} are missing: "
                                "train them with `python -m infer.demo` (or use a build that ships them)")

    h.measure(f"{suite}/demo-models", "engine", suite, fail)
    return False


def demo_pair(h: Harness, temperatures: tuple[float, ...] = (0.0, 1.0)) -> None:
    if not demo_models_present(h, "demo-pair"):
        return
    target, draft = demo_pair_paths(h)
    costs = h.spec_costs("costs/demo/graphs", target, draft, True).name
    h.spec_costs("costs/demo/eager", target, draft, False)
    h.projection("projection/demo", costs)
    for t in temperatures:
        wl = WORKLOADS["W1"].with_temperature(t)
        group = f"demo pair, W1 T={t:g}"
        tag = f"demo-w1-t{t:g}"
        base = h.engine(f"{tag}/plain", group, wl, {"model": target, **GRAPHS}).name
        spec = {"model": target, **GRAPHS, "use_speculative_decoding": True, "draft_model": draft,
                "spec_length": SPEC_K}
        refs = {"baseline": base, "costs": costs}
        h.engine(f"{tag}/spec-k5", group, wl, spec, refs)
        h.engine(f"{tag}/spec-adaptive", group, wl, {**spec, "spec_policy": "adaptive"}, refs,
                 paired_with={"model": target, **GRAPHS})
        tree_rows(h, f"{tag}/spec", group, wl, spec, base, costs)
        h.hf(f"{tag}/hf", group, wl, HFPeer(target), {"baseline": base})
        h.hf(f"{tag}/hf-assisted", group, wl, HFPeer(target, assistant=draft), {"baseline": base})


def tree_rows(h: Harness, tag: str, group: str, wl: Workload, spec: dict, base: str, costs: str | None,
              pairs: tuple[tuple[int, str], ...] = TREE_PAIRS) -> None:
    """Per pair: the chain of K drafts, then the tree verifying as many tokens a round
    (length_vs_chain: tokens per round against the chain's)."""
    for k, tree in pairs:
        chain = h.engine(f"{tag}-k{k}", group, wl, {**spec, "spec_length": k}, {"baseline": base, "costs": costs}).name
        tree_spec = {**spec, "spec_length": TreeShape.parse(tree).depth, "spec_tree": tree}
        h.engine(f"{tag}-tree-{tree.replace(',', 'x')}", group, wl, tree_spec, {"baseline": base, "chain": chain})


def w5_ngram(h: Harness, temperatures: tuple[float, ...] = (0.0, 1.0)) -> None:
    if not demo_models_present(h, "w5-ngram"):
        return
    target, draft = demo_pair_paths(h)
    costs = h.spec_costs("costs/demo/graphs", target, draft, True).name
    spec = {"model": target, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K}
    for t in temperatures:
        wl = WORKLOADS["W5"].with_temperature(t)
        group, tag = f"demo target, W5 code edit T={t:g}", f"w5-t{t:g}"
        base = h.engine(f"{tag}/plain", group, wl, {"model": target, **GRAPHS}).name
        refs = {"baseline": base, "costs": costs}
        h.engine(f"{tag}/ngram-k5", group, wl, {**spec, "speculative_method": "ngram"}, refs)
        h.engine(f"{tag}/ngram-adaptive", group, wl, {**spec, "speculative_method": "ngram",
                                                      "spec_policy": "adaptive"}, refs,
                 paired_with={"model": target, **GRAPHS})
        h.engine(f"{tag}/prompt-lookup-k5", group, wl, {**spec, "speculative_method": "prompt_lookup"}, refs)
        h.engine(f"{tag}/draft-k5", group, wl, {**spec, "draft_model": draft}, refs)
        tree_rows(h, f"{tag}/ngram", group, wl, {**spec, "speculative_method": "ngram"}, base, costs,
                  pairs=TREE_PAIRS[:1])
        h.hf(f"{tag}/hf-prompt-lookup", group, wl, HFPeer(target, prompt_lookup=10), {"baseline": base})
    for t in temperatures:
        wl = WORKLOADS["W1"].with_temperature(t)
        group, tag = f"demo target, W1 T={t:g} (n-gram must not slow it)", f"w1-ngram-t{t:g}"
        base = h.engine(f"{tag}/plain", group, wl, {"model": target, **GRAPHS}).name
        h.engine(f"{tag}/ngram-adaptive", group, wl, {**spec, "speculative_method": "ngram",
                                                      "spec_policy": "adaptive"}, {"baseline": base},
                 paired_with={"model": target, **GRAPHS})


def hf_static(h: Harness, shape: str = SHAPE_3B) -> None:
    label = _label(shape)
    group = f"W1 plain decode, {label} shape"
    h.hf(f"w1/{label}/hf-static-cache", group, WORKLOADS["W1"], HFPeer(shape, cache_implementation="static"),
         {"roofline": f"roofline/{label}", "baseline": f"w1/{label}/ours"})


def batch_sweep_rows(h: Harness, shape: str) -> None:
    h.batch_sweep(f"batch/{_label(shape)}", "decode step against batch size", {"model": shape, **GRAPHS},
                  (1, 2, 4, 8, 16, 32))


def decode_speed(h: Harness, sweeps: bool = True) -> None:
    """Batch-1 decode of both shapes against the roofline: overlapped (the default) and
    synchronous scheduling, FP8 weights; decode step time against batch size."""
    wl = WORKLOADS["W1"]
    for shape in (SHAPE_3B, SHAPE_1B):
        label = _label(shape)
        group = f"W1 plain decode, {label} shape"
        roof = h.roofline(shape, label).name
        base = h.engine(f"w1/{label}/ours", group, wl, {"model": shape, **GRAPHS}, {"roofline": roof}).name
        h.engine(f"w1/{label}/sync", group, wl, {"model": shape, **GRAPHS, "async_scheduling": False},
                 {"roofline": roof, "baseline": base})
        h.engine(f"w1/{label}/fp8", group, wl, {"model": shape, **GRAPHS, "quantization": "fp8"},
                 {"roofline": h.roofline(shape, label, "fp8").name, "baseline": base})
    for shape in (SHAPE_3B, SHAPE_1B) if sweeps else ():
        batch_sweep_rows(h, shape)


def costs_fp8(h: Harness) -> None:
    """c and v(K) of the 1B draft against the 3B target, the draft in bf16 and in FP8."""
    h.spec_costs("costs/3b-1b/graphs", SHAPE_3B, SHAPE_1B, True)
    h.projection("projection/3b-1b", "costs/3b-1b/graphs")
    h.spec_costs("costs/3b-1b-fp8/graphs", SHAPE_3B, SHAPE_1B, True, draft_quantization="fp8")
    h.projection("projection/3b-1b-fp8", "costs/3b-1b-fp8/graphs")


def speculation(h: Harness) -> None:
    """Where speculation pays and where it must not hurt: the 3B shape with a random 1B draft
    (fixed K, adaptive), the demo pair at T=0 / T=1 (fixed K, adaptive, an FP8 draft at T=1,
    chain K=6 against the tree "2,1,1"), n-gram drafting on W5 (fixed, adaptive, chain
    against tree) and W1 (fixed, adaptive) at T=0."""
    if demo_models_present(h, "demo-pair"):
        demo_speculation(h)
    wl = WORKLOADS["W1"]
    group = "W1 speculative, 3b shape, random 1b draft"
    # (plain decoding: decode-speed's row when it ran in this run)
    base = "w1/3b/ours" if h.run.get("w1/3b/ours") is not None else \
        h.engine("w1-spec/3b/plain", group, wl, {"model": SHAPE_3B, **GRAPHS}).name
    spec = {"model": SHAPE_3B, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K,
            "draft_model": SHAPE_1B}
    h.engine("w1-spec/3b/1b-draft-k5", group, wl, spec, {"baseline": base})
    h.engine("w1-spec/3b/1b-draft-adaptive", group, wl, {**spec, "spec_policy": "adaptive"}, {"baseline": base})


def demo_speculation(h: Harness) -> None:
    """The demo pair's rows of `speculation`."""
    target, draft = demo_pair_paths(h)
    for t in (1.0, 0.0):
        wl_t, tag = WORKLOADS["W1"].with_temperature(t), f"demo-w1-t{t:g}"
        group = f"demo pair, W1 T={t:g}"
        base = h.engine(f"{tag}/plain", group, wl_t, {"model": target, **GRAPHS}).name
        spec = {"model": target, **GRAPHS, "use_speculative_decoding": True, "draft_model": draft,
                "spec_length": SPEC_K}
        h.engine(f"{tag}/spec-k5", group, wl_t, spec, {"baseline": base})
        h.engine(f"{tag}/spec-adaptive", group, wl_t, {**spec, "spec_policy": "adaptive"}, {"baseline": base})
        if t > 0:
            h.engine(f"{tag}/spec-k5-fp8-draft", group, wl_t, {**spec, "draft_quantization": "fp8"},
                     {"baseline": base})
        tree_rows(h, f"{tag}/spec", group, wl_t, spec, base, None, pairs=TREE_PAIRS[:1])
    ngram = {"model": target, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K,
             "speculative_method": "ngram"}
    for name in ("W5", "W1"):
        wl_t, tag = WORKLOADS[name].with_temperature(0.0), f"{name.lower()}-ngram-t0"
        group = f"demo target, {name} T=0, n-gram drafts"
        base = h.engine(f"{tag}/plain", group, wl_t, {"model": target, **GRAPHS}).name
        h.engine(f"{tag}/ngram-k5", group, wl_t, ngram, {"baseline": base})
        h.engine(f"{tag}/ngram-adaptive", group, wl_t, {**ngram, "spec_policy": "adaptive"}, {"baseline": base})
        if name == "W5":
            h.engine(f"{tag}/prompt-lookup-k5", group, wl_t, {**ngram, "speculative_method": "prompt_lookup"},
                     {"baseline": base})
            tree_rows(h, f"{tag}/ngram", group, wl_t, ngram, base, None, pairs=TREE_PAIRS[:1])


def w2_batching(h: Harness, shape: str = SHAPE_3B) -> None:
    """W2 with continuous and with static batching (the runs of record's part of `w2`) in 8
    batch slots for its 32 requests: with slots for all of them both modes admit everything
    at once and run the same steps, so only fewer slots than requests tell them apart
    (static waits for a batch's longest request before admitting more). Prefix caching off:
    W2 shares no prefix, and with the cache on, the repeats of the same prompts would hit it
    (the first timed run a full prefill, the others none, and prefill shapes the warm-up
    never met)."""
    label = _label(shape)
    group = f"W2 batching, {label} shape, 8 slots"
    off = {"model": shape, **GRAPHS, "enable_prefix_caching": False, "max_batch_size": 8}
    base = h.engine(f"w2/{label}/continuous", group, WORKLOADS["W2"], off).name
    h.engine(f"w2/{label}/static", group, WORKLOADS["W2"], {**off, "batching_mode": "static"}, {"baseline": base})


def tp(h: Harness, size: int = 2) -> None:
    """Tensor parallelism (needs `size` GPUs), most important numbers first. Dummy weights
    shard exactly (each rank keeps its part of the one-GPU dummy model), so the "greedy
    match" column compares TP=N tokens with TP=1's: equal up to rounding near-ties."""
    tp_n = {**GRAPHS, "tensor_parallel_size": size}
    w1, w2 = WORKLOADS["W1"], WORKLOADS["W2"]
    group = f"TP={size}: 8b shape, W1 batch-1 decode"
    one = {"model": SHAPE_8B, **GRAPHS}
    base = h.engine("tp/8b/w1-tp1", group, w1, one).name
    h.engine(f"tp/8b/w1-tp{size}", group, w1, {"model": SHAPE_8B, **tp_n}, {"baseline": base}, paired_with=one)
    h.engine(f"tp/8b/w1-tp{size}-sync", group, w1, {"model": SHAPE_8B, **tp_n, "async_scheduling": False},
             {"baseline": base})
    tp_drafts(h, size)
    h.collectives(f"tp/8b/collectives-tp{size}", f"TP={size}: collectives", w1, {"model": SHAPE_8B, **tp_n})
    group = f"TP={size}: 8b shape, W2 throughput"
    base = h.engine("tp/8b/w2-tp1", group, w2, one).name
    h.engine(f"tp/8b/w2-tp{size}", group, w2, {"model": SHAPE_8B, **tp_n}, {"baseline": base})
    tp_layouts(h, size)
    # (eager steps too: their kernels are traced for certain, and show the launch-bound step)
    h.collectives(f"tp/8b/collectives-tp{size}-eager", f"TP={size}: collectives", w1,
                  {"model": SHAPE_8B, "tensor_parallel_size": size})


def tp_drafts(h: Harness, size: int) -> None:
    """The 3B shape drafted by the 1B shape (or itself) at TP=size, against plain TP=size."""
    tp_n, w1 = {**GRAPHS, "tensor_parallel_size": size}, WORKLOADS["W1"]
    group = f"TP={size}: 3b shape drafted by the 1b shape (dummy weights: acceptance ~0), W1"
    base = h.engine(f"tp/3b/plain-tp{size}", group, w1, {"model": SHAPE_3B, **tp_n}).name
    spec = {"model": SHAPE_3B, **tp_n, "use_speculative_decoding": True, "draft_model": SHAPE_1B, "spec_length": SPEC_K}
    h.engine(f"tp/3b-1b/k5-draft-driver-tp{size}", group, w1, spec, {"baseline": base})
    h.engine(f"tp/3b-1b/k5-draft-sharded-tp{size}", group, w1, {**spec, "tensor_parallel_draft": "sharded"},
             {"baseline": base})
    h.engine(f"tp/3b-3b/k5-self-draft-sharded-tp{size}", group, w1,
             {**spec, "draft_model": SHAPE_3B, "tensor_parallel_draft": "sharded"}, {"baseline": base})


def tp_layouts(h: Harness, size: int) -> None:
    """The embedding and lm_head layouts at TP=size, against the default."""
    tp_n, w1 = {**GRAPHS, "tensor_parallel_size": size}, WORKLOADS["W1"]
    group = f"TP={size}: 8b shape, W1, embedding and lm_head layouts (default: replicated embedding, " \
            "vocabulary-parallel lm_head)"
    base = f"tp/8b/w1-tp{size}"
    h.engine(f"tp/8b/w1-tp{size}-lm-head-replicated", group, w1,
             {"model": SHAPE_8B, **tp_n, "tensor_parallel_lm_head": "replicated"}, {"baseline": base})
    h.engine(f"tp/8b/w1-tp{size}-embedding-vocab-parallel", group, w1,
             {"model": SHAPE_8B, **tp_n, "tensor_parallel_embedding": "vocab_parallel"}, {"baseline": base})


def all_gpu(h: Harness) -> None:
    """The runs of record (docs/benchmarks.md), most important first, within --max-seconds."""
    h.bandwidth()
    decode_speed(h, sweeps=False)
    speculation(h)
    costs_fp8(h)
    for shape in (SHAPE_3B, SHAPE_1B):
        batch_sweep_rows(h, shape)
    w2_batching(h)
    hf_static(h)
    h.bandwidth("bandwidth-end")


def smoke(h: Harness) -> None:
    """Each kind of measurement once on --model (default: the demo pair), CPU-friendly."""
    if not demo_models_present(h, "smoke"):
        return
    model = h.options.model or str(DEMO_TARGET)
    draft = h.options.draft_model or (model if h.options.model else str(DEMO_DRAFT))
    wl, group = WORKLOADS["W1"], f"smoke, {model}"
    roof = h.roofline(model, "smoke").name
    costs = h.spec_costs("costs/smoke", model, draft, False).name
    h.projection("projection/smoke", costs)
    base = h.engine("smoke/plain", group, wl, {"model": model}, {"roofline": roof}).name
    refs = {"baseline": base, "costs": costs}
    spec = {"model": model, "use_speculative_decoding": True, "spec_length": 4}
    h.engine("smoke/spec-k4", group, wl, {**spec, "draft_model": draft}, refs)
    edit = replace(WORKLOADS["W5"], prompt_len=(160, 160), edit_head_tokens=16)
    h.engine("smoke/ngram-k4", "smoke, code edit", edit, {**spec, "speculative_method": "ngram"})
    h.hf("smoke/hf", group, wl, HFPeer(model), {"roofline": roof, "baseline": base})
    h.hf("smoke/hf-assisted", group, wl, HFPeer(model, assistant=draft), {"baseline": base})


SUITES: dict[str, Callable[[Harness], None]] = {
    "w1-plain": w1_plain, "spec-costs": spec_costs, "w1-spec-dummy": w1_spec_dummy, "w2": w2,
    "decode-speed": decode_speed, "costs-fp8": costs_fp8, "speculation": speculation,
    "demo-pair": demo_pair, "w5-ngram": w5_ngram, "hf-static": hf_static, "all-gpu": all_gpu, "smoke": smoke,
    "tp": tp,
}


def get_suite(name: str) -> Callable[[Harness], None]:
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {sorted(SUITES)}")
    return SUITES[name]


def custom_workload(h: Harness, workload: Workload, overrides: dict, hf: bool) -> None:
    """`infer bench --workload ...`: roofline of the model, the engine run, optionally HF."""
    model = overrides.get("model") or str(DEMO_TARGET)
    label = _label(model)
    roof = h.roofline(model, label).name
    base = h.engine(f"{workload.name}/{label}/ours", workload.label, workload, overrides, {"roofline": roof}).name
    if hf:
        h.hf(f"{workload.name}/{label}/hf", workload.label, workload, HFPeer(model, load_format=overrides.get(
            "load_format", "auto")), {"roofline": roof, "baseline": base})
