"""The benchmark table: every row defined once, and the suites as named selections of it.

`SUITES` maps each suite (decode-speed, speculation, costs, w2, tp, smoke, acceptance-sweep,
serve; all-gpu the union of the one-GPU ones) to a `Suite`: what it measures, the rows it
owns (`decode_speed_rows`, `speculation_rows`, `costs_rows`, `w2_rows`, `tp_rows`,
`smoke_rows`, `serve_rows`, `sweep_rows`) and the GPUs it needs. `build_table` defines every
row once; `suite_rows` gives a suite's rows, after them the rows they are compared with (a
baseline, a roofline, the copy bandwidth), whichever suite owns those. `custom_rows`: one
workload from the command line. `Models`: the demo pair, or --model / --draft-model. What
each suite measures: docs/benchmarks.md, "Running".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from infer_bench.measures import (XGRAMMAR, acceptance_sweep_rows, bandwidth_row, batch_sweep_row, collectives_row,
                                  costs_row, engine_row, gpt_fast_row, hf_row, prefill_row, projection_row,
                                  roofline_row)
from infer_bench.peers import HFPeer
from infer_bench.rows import CudaDevices, Files, HarnessOptions, Need, Row, index_rows
from infer_bench.serve import ServeSetup, serve_rows as serve_rate_rows
from infer_bench.suffix_rows import suffix_rows
from infer_bench.sweep import SweepSetup, SweepShape
from infer_bench.workloads import JSON_RECORDS, WORKLOADS, Workload
from infer.engine.loading import DEMO_DRAFT, DEMO_EAGLE3, DEMO_TARGET, DEMO_TRAIN_COMMAND
from infer.speculative.tree import TreeShape

SHAPE_3B, SHAPE_1B, SHAPE_8B = "dummy:llama-3.2-3b", "dummy:llama-3.2-1b", "dummy:llama-3.1-8b"
HEAD_3B = "dummy-eagle3:llama-3.2-3b"  # an EAGLE-3 head of the 3B shape, dummy weights
MEDUSA_3B = "dummy-medusa:llama-3.2-3b"  # five Medusa heads of one block for the 3B shape, dummy weights
EAGLE_SWEEP_CHAINS = tuple(range(2, 7))
SPEC_K = 5
CHAIN_K, TREE = 6, "2,1,1"  # a chain and a tree verifying as many tokens a round (K + 1 = N + 1)
GRAPHS = {"use_cuda_graphs": True}
TP_SIZE = 2
SWEEP_CHAINS = tuple(range(1, 7))
# the trees the tree projection ranks best for c 0.4-0.5 and v(N) near 1 at alpha 0.6-0.9
SWEEP_TREES = ("2,2", "3,1", "2,2,1")
SWEEP_ALPHAS = (0.6, 0.7, 0.8, 0.9)
VOCAB_32K = 32768  # a reduced draft vocabulary's ids (the costs' and the sweep's rows)
# speculation against plain decoding as the batch grows (the batch gate on): the 1B draft at
# K=3 and an EAGLE-3 head at K=4, at alpha 0.8, SPEC_BATCH_TOKENS new tokens a request (long
# enough that the first token and a run's tail do not decide the figure)
SPEC_BATCHES, SPEC_BATCH_ALPHA, SPEC_BATCH_TOKENS = (1, 8, 16, 32, 64, 128), 0.8, 256
# serving batches: decode steps at these batches after prompts of BATCH_CONTEXT tokens (about
# a ShareGPT-like request's prompt and output together), a step budget that prefills them in
# a few steps
SERVING_BATCHES, BATCH_CONTEXT, BIG_STEP = (128, 256), 512, {"max_num_batched_tokens": 8192}
PREFILL_16X2048 = Workload("prefill-16x2048", 16, (2048, 2048), (1, 1),
                           description="16 prompts of 2,048 tokens, prefilled up to their first token")


@dataclass(frozen=True)
class Models:
    """The models of the rows that --model / --draft-model replace; `needs` is met when they
    exist (the bundled demo pair may be absent from a source checkout)."""

    target: str
    draft: str
    needs: tuple[Need, ...]
    serve: ServeSetup = ServeSetup()
    head: str | None = None  # the target's EAGLE-3 head: the demo target's own, None for --model

    @classmethod
    def from_options(cls, options: HarnessOptions, serve: ServeSetup | None = None) -> Models:
        given_draft = options.draft_model or options.model  # --model alone drafts for itself
        target, draft = options.model or str(DEMO_TARGET), given_draft or str(DEMO_DRAFT)
        demo = tuple(p for p, given in ((DEMO_TARGET, options.model), (DEMO_DRAFT, given_draft)) if given is None)
        hint = (f"train them with `{DEMO_TRAIN_COMMAND}` in a checkout (or use a build that ships them), "
                "or pass --model")
        head = str(DEMO_EAGLE3) if options.model is None else None
        return cls(target, draft, (Files(demo, hint),) if demo else (), serve or ServeSetup(), head)


def _label(model: str) -> str:
    return model.removeprefix("dummy:llama-3.2-").removeprefix("dummy:llama-3.1-")


def _int4_row(label: str, shape: str, group: str, wl: Workload) -> list[Row]:
    """The int4 roofline (codes, scales and offsets counted) and W1 decode in int4 against bf16."""
    roof, ours = f"roofline/{label}", f"w1/{label}/ours"
    return [roofline_row(label, shape, "int4"),
            engine_row(f"w1/{label}/int4", "the same with int4 weights (groups of 128, 8-bit head), quantized at "
                       "load", group, wl, {"model": shape, **GRAPHS, "quantization": "int4"},
                       {"roofline": f"{roof}-int4", "baseline": ours})]


def decode_speed_rows(m: Models) -> list[Row]:
    rows: list[Row] = []
    wl = WORKLOADS["W1"]
    for shape in (SHAPE_3B, SHAPE_1B):
        label = _label(shape)
        group, roof, ours = f"W1 plain decode, {label} shape", f"roofline/{label}", f"w1/{label}/ours"
        rows += [
            roofline_row(label, shape), roofline_row(label, shape, "fp8"),
            engine_row(ours, f"W1 decode of the {label} shape, CUDA graphs, overlapped steps", group, wl,
                       {"model": shape, **GRAPHS}, {"roofline": roof}),
            engine_row(f"w1/{label}/sync", "the same with synchronous steps", group, wl,
                       {"model": shape, **GRAPHS, "async_scheduling": False}, {"roofline": roof, "baseline": ours}),
            engine_row(f"w1/{label}/fp8", "the same with FP8 weights", group, wl,
                       {"model": shape, **GRAPHS, "quantization": "fp8"},
                       {"roofline": f"{roof}-fp8", "baseline": ours})]
        if shape == SHAPE_3B:
            rows += _int4_row(label, shape, group, wl)
    group = "W1 plain decode, 8b shape"
    rows += [roofline_row("8b", SHAPE_8B),
             engine_row("w1/8b/ours", "W1 decode of the 8b shape, CUDA graphs, overlapped steps", group, wl,
                        {"model": SHAPE_8B, **GRAPHS}, {"roofline": "roofline/8b"}),
             *_int4_row("8b", SHAPE_8B, group, wl)]
    for shape in (SHAPE_3B, SHAPE_1B):
        rows.append(batch_sweep_row(f"batch/{_label(shape)}", f"decode step time of the {_label(shape)} shape "
                                    "at batch 1..32", "decode step against batch size", {"model": shape, **GRAPHS},
                                    (1, 2, 4, 8, 16, 32)))
    rows.append(batch_sweep_row("batch/3b-int4/b16", "decode step time of the 3b shape in int4 at batch 16 (x "
                                "baseline: against batch/3b at 16)", "decode step against batch size",
                                {"model": SHAPE_3B, **GRAPHS, "quantization": "int4"}, (16,),
                                refs={"baseline": "batch/3b"}))
    for b in SERVING_BATCHES:
        rows.append(batch_sweep_row(f"batch/3b/b{b}", f"decode step time of the 3b shape at batch {b} after "
                                    f"{BATCH_CONTEXT}-token prompts, against its bytes limit (weights + KV read)",
                                    "decode step against batch size", {"model": SHAPE_3B, **GRAPHS, **BIG_STEP},
                                    (b,), prompt_len=BATCH_CONTEXT))
    for shape in (SHAPE_3B, SHAPE_1B):
        label = _label(shape)
        rows.append(gpt_fast_row(f"w1/{label}/gpt-fast", f"gpt-fast's compiled decode, {label} shape (--gpt-fast PATH)",
                                 f"W1 plain decode, {label} shape", wl, shape,
                                 {"roofline": f"roofline/{label}", "baseline": f"w1/{label}/ours"}))
    rows.append(hf_row("w1/3b/hf-static-cache", "transformers generate, static cache (compiled), 3B shape",
                       "W1 plain decode, 3b shape", wl, HFPeer(SHAPE_3B, cache_implementation="static"),
                       {"roofline": "roofline/3b", "baseline": "w1/3b/ours"}))
    return rows


def _chain_and_tree(tag: str, group: str, wl: Workload, spec: dict, base: str, needs: tuple[Need, ...]) -> list[Row]:
    """A chain of CHAIN_K drafts, then the tree TREE verifying as many tokens a round
    (length_vs_chain: its tokens per round against the chain's)."""
    chain = engine_row(f"{tag}-k{CHAIN_K}", f"chain of {CHAIN_K} drafts", group, wl, {**spec, "spec_length": CHAIN_K},
                       {"baseline": base}, needs=needs)
    tree = engine_row(f"{tag}-tree-{TREE.replace(',', 'x')}", f"tree {TREE}, as many verified tokens as the chain",
                      group, wl, {**spec, "spec_length": TreeShape.parse(TREE).depth, "spec_tree": TREE},
                      {"baseline": base, "chain": chain.name}, needs=needs)
    return [chain, tree]


def _constrained(tag: str, group: str, wl: Workload, plain: dict, spec: dict, spec_name: str,
                 needs: tuple[Need, ...]) -> list[Row]:
    """Plain decoding and speculation under JSON_RECORDS: the plain row's "x baseline" is the
    grammar's cost a token, the speculative row's is its speedup under the grammar (greedy
    tokens compared with the constrained plain row's), its acceptance beside `spec_name`'s."""
    json_wl, grammar = wl.constrained(JSON_RECORDS), (*needs, XGRAMMAR)
    base = f"{tag}/plain-json"
    return [engine_row(base, "plain decoding, output constrained to a JSON schema (x baseline: its cost)", group,
                       json_wl, plain, {"baseline": f"{tag}/plain"}, needs=grammar),
            engine_row(f"{tag}/{spec_name}-json", f"{spec_name} under the same JSON schema (x baseline: against "
                       "plain-json; acceptance against unconstrained)", group, json_wl, spec, {"baseline": base},
                       needs=grammar)]


def _fixed_and_adaptive(tag: str, plain_what: str, group: str, wl: Workload, target: str,
                        drafts: tuple[str, str, dict], needs: tuple[Need, ...]) -> list[Row]:
    """`tag`/plain, then the drafts (a row-name stem, what they are, their overrides) at the fixed K
    (`-k5`) and under the adaptive policy, each against the plain row."""
    stem, what, spec = drafts
    base = f"{tag}/plain"
    return [engine_row(base, plain_what, group, wl, {"model": target, **GRAPHS}, needs=needs),
            engine_row(f"{tag}/{stem}-k5", f"{what}, fixed K=5", group, wl, spec, {"baseline": base}, needs=needs),
            engine_row(f"{tag}/{stem}-adaptive", f"{what}, adaptive K", group, wl, {**spec, "spec_policy": "adaptive"},
                       {"baseline": base}, needs=needs)]


def speculation_rows(m: Models) -> list[Row]:
    rows: list[Row] = []
    for t in (1.0, 0.0):
        wl, tag, group = WORKLOADS["W1"].with_temperature(t), f"demo-w1-t{t:g}", f"demo pair, W1 T={t:g}"
        base = f"{tag}/plain"
        spec = {"model": m.target, **GRAPHS, "use_speculative_decoding": True, "draft_model": m.draft,
                "spec_length": SPEC_K}
        rows += _fixed_and_adaptive(tag, f"plain decoding of {m.target}, W1 T={t:g}", group, wl, m.target,
                                    ("spec", "draft model", spec), m.needs)
        if m.head is not None:
            hint = f"train it with `{DEMO_TRAIN_COMMAND} --eagle-head` in a checkout"
            head_needs = (*m.needs, Files((DEMO_EAGLE3,), hint))
            rows.append(engine_row(f"{tag}/eagle-k5", "the target's trained EAGLE-3 head, fixed K=5 (against "
                                   "spec-k5: head vs draft model)", group, wl,
                                   {**spec, "speculative_method": "eagle3", "draft_model": m.head},
                                   {"baseline": base}, needs=head_needs))
        if t > 0:
            rows.append(engine_row(f"{tag}/spec-k5-fp8-draft", "draft model in FP8, fixed K=5", group, wl,
                                   {**spec, "draft_quantization": "fp8"}, {"baseline": base}, needs=m.needs))
        rows += _chain_and_tree(f"{tag}/spec", group, wl, spec, base, m.needs)
        rows += _constrained(tag, group, wl, {"model": m.target, **GRAPHS}, spec, "spec-k5", m.needs)
    ngram = {"model": m.target, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K,
             "speculative_method": "ngram"}
    for name in ("W5", "W1"):
        wl, tag = WORKLOADS[name].with_temperature(0.0), f"{name.lower()}-ngram-t0"
        group, base = f"demo target, {name} T=0, n-gram drafts", f"{tag}/plain"
        rows += _fixed_and_adaptive(tag, f"plain decoding, {name} T=0", group, wl, m.target,
                                    ("ngram", "n-gram drafts", ngram), m.needs)
        if name == "W5":
            rows.append(engine_row(f"{tag}/prompt-lookup-k5", "prompt lookup, fixed K=5", group, wl,
                                   {**ngram, "speculative_method": "prompt_lookup"}, {"baseline": base},
                                   needs=m.needs))
            rows += _chain_and_tree(f"{tag}/ngram", group, wl, ngram, base, m.needs)
    rows += suffix_rows({"model": m.target, **GRAPHS}, SPEC_K, m.needs)
    group = "W1 speculative, 3b shape, random 1b draft"
    spec = {"model": SHAPE_3B, **GRAPHS, "use_speculative_decoding": True, "spec_length": SPEC_K,
            "draft_model": SHAPE_1B}
    rows += [engine_row("w1-spec/3b/1b-draft-k5", "3B shape, random 1B draft, fixed K=5 (acceptance ~0)", group,
                        WORKLOADS["W1"], spec, {"baseline": "w1/3b/ours"}),
             engine_row("w1-spec/3b/1b-draft-adaptive", "the same, adaptive K (must stay at plain speed)", group,
                        WORKLOADS["W1"], {**spec, "spec_policy": "adaptive"}, {"baseline": "w1/3b/ours"})]
    return rows


def costs_rows(m: Models) -> list[Row]:
    return [costs_row("costs/3b-1b/graphs", "c and v(K): 1B-shape draft, 3B-shape target, CUDA graphs",
                      SHAPE_3B, SHAPE_1B, True),
            projection_row("projection/3b-1b", "costs/3b-1b/graphs"),
            costs_row("costs/3b-1b-fp8/graphs", "the same with the draft in FP8", SHAPE_3B, SHAPE_1B, True, "fp8"),
            projection_row("projection/3b-1b-fp8", "costs/3b-1b-fp8/graphs"),
            costs_row("costs/3b-1b-int4/graphs", "the same with the draft in int4 (8-bit head)", SHAPE_3B, SHAPE_1B,
                      True, "int4"),
            projection_row("projection/3b-1b-int4", "costs/3b-1b-int4/graphs"),
            costs_row("costs/3b-1b-v32k/graphs", "the bf16 draft with a reduced vocabulary: lm_head rows of "
                      "32768 ids (spec_draft_vocab)", SHAPE_3B, SHAPE_1B, True, draft_vocab=VOCAB_32K),
            projection_row("projection/3b-1b-v32k", "costs/3b-1b-v32k/graphs"),
            costs_row("costs/3b-1b-fp8-v32k/graphs", "the FP8 draft with a reduced vocabulary (32768 ids)", SHAPE_3B,
                      SHAPE_1B, True, "fp8", draft_vocab=VOCAB_32K),
            projection_row("projection/3b-1b-fp8-v32k", "costs/3b-1b-fp8-v32k/graphs"),
            costs_row("costs/3b-eagle3/graphs", "c and v(K): an EAGLE-3 head (dummy weights, 32000 draft ids) for "
                      "the 3B shape, its step what one more step adds to a graphed round", SHAPE_3B, HEAD_3B, True,
                      method="eagle3"),
            projection_row("projection/3b-eagle3", "costs/3b-eagle3/graphs"),
            costs_row("costs/3b-medusa/graphs", "c and v(K): Medusa heads (dummy weights, 5 heads of one block, "
                      "full vocabulary) for the 3B shape, their step what one more head adds to a round", SHAPE_3B,
                      MEDUSA_3B, True, method="medusa"),
            costs_row("costs/3b-medusa-fp8/graphs", "the same with the heads in FP8", SHAPE_3B, MEDUSA_3B, True,
                      "fp8", method="medusa"),
            projection_row("projection/3b-medusa", "costs/3b-medusa/graphs")]


def w2_rows(m: Models) -> list[Row]:
    """W2 with continuous and with static batching in 8 batch slots for its 32 requests: with
    slots for all of them both modes admit everything at once and run the same steps, so only
    fewer slots than requests tell them apart. Continuous batching once more with mixed
    batches off: each admitted prompt's prefill then runs beside the decode step, not in it;
    and with the engine's default batch size (sized from memory: every request at once), the
    TTFT a user gets without tuning. Prefix caching off: W2 shares no prefix, and with the
    cache on the repeats of the same prompts would hit it."""
    group, off = "W2 batching, 3b shape, 8 slots", {"model": SHAPE_3B, **GRAPHS, "enable_prefix_caching": False,
                                                    "max_batch_size": 8}
    prefix_group, on = "W2-prefix, 3b shape", {"model": SHAPE_3B, **GRAPHS, "enable_prefix_caching": True}
    return [engine_row("w2/3b/continuous", "W2, continuous batching, 8 slots", group, WORKLOADS["W2"], off),
            engine_row("w2/3b/static", "W2, static batching, 8 slots", group, WORKLOADS["W2"],
                       {**off, "batching_mode": "static"}, {"baseline": "w2/3b/continuous"}),
            engine_row("w2/3b/separate", "W2, continuous, prefill and decode in a forward each (mixed "
                       "batches off)", group, WORKLOADS["W2"], {**off, "mixed_batches": False},
                       {"baseline": "w2/3b/continuous"}),
            engine_row("w2/3b/default-batch", "W2, continuous, the engine's default max_batch_size (sized "
                       "from memory)", group, WORKLOADS["W2"], {**off, "max_batch_size": None},
                       {"baseline": "w2/3b/continuous"}),
            engine_row("w2-prefix/3b/prefix-cache", "W2-prefix with prefix caching", prefix_group,
                       WORKLOADS["W2-prefix"], on),
            engine_row("w2-prefix/3b/no-prefix-cache", "W2-prefix without prefix caching", prefix_group,
                       WORKLOADS["W2-prefix"], {**on, "enable_prefix_caching": False},
                       {"baseline": "w2-prefix/3b/prefix-cache"}),
            # prefix caching off: the repeated timed runs would find their prompts cached
            prefill_row("prefill/3b/16x2048", "16 prompts of 2,048 random ids to their first tokens, 3b shape "
                        "(model FLOPs utilisation)", "prefill, 3b shape", PREFILL_16X2048,
                        {"model": SHAPE_3B, **GRAPHS, **BIG_STEP, "enable_prefix_caching": False})]


ONE_SHOT = {"tensor_parallel_all_reduce": "one-shot"}


def tp_rows(m: Models) -> list[Row]:
    """Most important first. Dummy weights shard exactly, so "greedy match" compares TP=N
    tokens with TP=1's: equal up to rounding near-ties."""
    n, gpus = TP_SIZE, (CudaDevices(TP_SIZE),)
    tp_n, one = {**GRAPHS, "tensor_parallel_size": n}, {"model": SHAPE_8B, **GRAPHS}
    w1, w2 = WORKLOADS["W1"], WORKLOADS["W2"]
    g1, g3 = f"TP={n}: 8b shape, W1 batch-1 decode", f"TP={n}: 3b shape drafted by the 1b shape (acceptance ~0), W1"
    g2, gl = f"TP={n}: 8b shape, W2 throughput", f"TP={n}: 8b shape, W1, embedding and lm_head layouts"
    spec = {"model": SHAPE_3B, **tp_n, "use_speculative_decoding": True, "draft_model": SHAPE_1B, "spec_length": SPEC_K}
    base3, base8 = f"tp/3b/plain-tp{n}", f"tp/8b/w1-tp{n}"
    return [
        engine_row("tp/8b/w1-tp1", "8B shape on one GPU", g1, w1, one, needs=gpus),
        engine_row(base8, f"8B shape at TP={n}, overlapped steps (paired)", g1, w1, {"model": SHAPE_8B, **tp_n},
                   {"baseline": "tp/8b/w1-tp1"}, paired_with=one, needs=gpus),
        engine_row(f"{base8}-sync", "the same, synchronous steps", g1, w1,
                   {"model": SHAPE_8B, **tp_n, "async_scheduling": False}, {"baseline": "tp/8b/w1-tp1"}, needs=gpus),
        engine_row(f"{base8}-one-shot", "the one-shot all-reduce for small messages", g1, w1,
                   {"model": SHAPE_8B, **tp_n, **ONE_SHOT}, {"baseline": "tp/8b/w1-tp1"}, needs=gpus),
        engine_row(base3, f"3B shape at TP={n}", g3, w1, {"model": SHAPE_3B, **tp_n}, needs=gpus),
        engine_row(f"tp/3b-1b/k5-draft-driver-tp{n}", "1B draft on the driver, K=5", g3, w1, spec,
                   {"baseline": base3}, needs=gpus),
        engine_row(f"tp/3b-1b/k5-draft-sharded-tp{n}", "1B draft sharded, K=5", g3, w1,
                   {**spec, "tensor_parallel_draft": "sharded"}, {"baseline": base3}, needs=gpus),
        engine_row(f"tp/3b-3b/k5-self-draft-sharded-tp{n}", "the 3B drafting for itself, sharded, K=5", g3, w1,
                   {**spec, "draft_model": SHAPE_3B, "tensor_parallel_draft": "sharded"}, {"baseline": base3},
                   needs=gpus),
        collectives_row(f"tp/8b/collectives-tp{n}", "the collectives' time a decode step (profile, rank 0)",
                        f"TP={n}: collectives", w1, {"model": SHAPE_8B, **tp_n}, needs=gpus),
        collectives_row(f"tp/8b/collectives-tp{n}-one-shot", "the same with the one-shot all-reduce",
                        f"TP={n}: collectives", w1, {"model": SHAPE_8B, **tp_n, **ONE_SHOT}, needs=gpus),
        engine_row("tp/8b/w2-tp1", "W2 on one GPU", g2, w2, one, needs=gpus),
        engine_row(f"tp/8b/w2-tp{n}", f"W2 at TP={n}", g2, w2, {"model": SHAPE_8B, **tp_n},
                   {"baseline": "tp/8b/w2-tp1"}, needs=gpus),
        engine_row(f"tp/8b/w2-tp{n}-one-shot", f"W2 at TP={n}, one-shot all-reduce", g2, w2,
                   {"model": SHAPE_8B, **tp_n, **ONE_SHOT}, {"baseline": "tp/8b/w2-tp1"}, needs=gpus),
        engine_row(f"{base8}-lm-head-replicated", "replicated lm_head", gl, w1,
                   {"model": SHAPE_8B, **tp_n, "tensor_parallel_lm_head": "replicated"}, {"baseline": base8},
                   needs=gpus),
        engine_row(f"{base8}-embedding-vocab-parallel", "vocabulary-parallel embedding", gl, w1,
                   {"model": SHAPE_8B, **tp_n, "tensor_parallel_embedding": "vocab_parallel"}, {"baseline": base8},
                   needs=gpus),
        # (eager steps too: their kernels are traced for certain, and show the launch-bound step)
        collectives_row(f"tp/8b/collectives-tp{n}-eager", "the collectives' time a step without CUDA graphs",
                        f"TP={n}: collectives", w1, {"model": SHAPE_8B, "tensor_parallel_size": n}, needs=gpus)]


def smoke_rows(m: Models) -> list[Row]:
    wl, group, needs = WORKLOADS["W1"], f"smoke, {m.target}", m.needs
    spec = {"model": m.target, "use_speculative_decoding": True, "spec_length": 4}
    edit = replace(WORKLOADS["W5"], prompt_len=(160, 160), edit_head_tokens=16)
    refs = {"roofline": "roofline/smoke", "baseline": "smoke/plain"}
    return [roofline_row("smoke", m.target, needs=needs),
            costs_row("costs/smoke", "c and v(K) of the smoke pair, eager", m.target, m.draft, False, needs=needs),
            projection_row("projection/smoke", "costs/smoke"),
            engine_row("smoke/plain", "plain decoding, W1", group, wl, {"model": m.target},
                       {"roofline": "roofline/smoke"}, needs=needs),
            engine_row("smoke/spec-k4", "draft model, K=4", group, wl, {**spec, "draft_model": m.draft},
                       {"baseline": "smoke/plain", "costs": "costs/smoke"}, needs=needs),
            *_constrained("smoke", group, wl, {"model": m.target}, {**spec, "draft_model": m.draft}, "spec-k4", needs),
            engine_row("smoke/ngram-k4", "n-gram drafts, K=4, a short code edit", "smoke, code edit", edit,
                       {**spec, "speculative_method": "ngram"}, needs=needs),
            hf_row("smoke/hf", "transformers generate, same weights", group, wl, HFPeer(m.target), refs, needs),
            hf_row("smoke/hf-assisted", "transformers assisted generation with the draft", group, wl,
                   HFPeer(m.target, assistant=m.draft), {"baseline": "smoke/plain"}, needs)]


def serve_rows(m: Models) -> list[Row]:
    """Our server runs the target (the demo target unless --model); a --url needs no model here."""
    demo = m.target == str(DEMO_TARGET)
    hint = f"train it with `{DEMO_TRAIN_COMMAND}` in a checkout, or pass --model"
    needs = (Files((DEMO_TARGET,), hint),) if demo else ()
    return serve_rate_rows(m.serve, m.target, needs)


def sweep_setup() -> SweepSetup:
    """The acceptance sweep of record: the 3B shape drafted by the 1B shape."""
    shapes = tuple(SweepShape.chain(k) for k in SWEEP_CHAINS) + tuple(SweepShape.tree(t) for t in SWEEP_TREES)
    return SweepSetup(SHAPE_3B, SHAPE_1B, f"{_label(SHAPE_3B)}-{_label(SHAPE_1B)}", shapes, SWEEP_ALPHAS)


def vocab_sweep_setup() -> SweepSetup:
    """The 1B draft with a reduced vocabulary (its lowest 32,768 ids: on dummy weights only the
    cost counts), bf16, FP8 and int4: chains K=2..4 and a 2,2 tree at alpha 0.6 and 0.8 (c and
    v(K): the costs suite's rows)."""
    shapes = tuple(SweepShape.chain(k) for k in (2, 3, 4)) + (SweepShape.tree("2,2"),)
    return SweepSetup(SHAPE_3B, SHAPE_1B, f"{_label(SHAPE_3B)}-{_label(SHAPE_1B)}", shapes, (0.6, 0.8),
                      draft_quantizations=(None, "fp8", "int4"), draft_vocab=VOCAB_32K, costs=False)


def eagle_sweep_setup() -> SweepSetup:
    """The 3B shape drafted by an EAGLE-3 head of its shape (dummy weights), chains K=2..6."""
    return SweepSetup(SHAPE_3B, HEAD_3B, f"{_label(SHAPE_3B)}-eagle3",
                      tuple(SweepShape.chain(k) for k in EAGLE_SWEEP_CHAINS), SWEEP_ALPHAS,
                      draft_quantizations=(None,), method="eagle3")


def sweep_rows(m: Models) -> list[Row]:
    setups = [sweep_setup(), vocab_sweep_setup(), eagle_sweep_setup(), *batch_sweep_setups()]
    return [row for setup in setups for row in acceptance_sweep_rows(setup)]


def batch_sweep_setups() -> list[SweepSetup]:
    """Per batch size, the draft model and an EAGLE-3 head at controlled acceptance, each with
    its plain baseline at that batch: `max(4, B)` prompts of 128 tokens, B decoding at once;
    the batch gate on (rounds only where they pay), as a GPU engine runs by default; c and
    v(K) are the alpha sweeps' rows."""
    setups = []
    for b in SPEC_BATCHES:
        n = SPEC_BATCH_TOKENS
        wl = Workload(f"spec-batch-b{b}", max(4, b), (128, 128), (n, n), temperature=0.0,
                      description=f"{max(4, b)} prompts of 128 tokens, {n} new tokens each, {b} at once, T=0")
        setups.append(SweepSetup(SHAPE_3B, SHAPE_1B, f"{_label(SHAPE_3B)}-{_label(SHAPE_1B)}-b{b}",
                                 (SweepShape.chain(3),), (SPEC_BATCH_ALPHA,), (None,), wl, batch_size=b,
                                 batch_gate=True, costs=False))
        setups.append(SweepSetup(SHAPE_3B, HEAD_3B, f"{_label(SHAPE_3B)}-eagle3-b{b}", (SweepShape.chain(4),),
                                 (SPEC_BATCH_ALPHA,), (None,), wl, method="eagle3", batch_size=b, batch_gate=True,
                                 costs=False))
    return setups


@dataclass(frozen=True)
class Suite:
    what: str
    rows: Callable[[Models], list[Row]] | None  # the rows this suite owns; None: a union of suites
    gpus: int  # GPUs it needs (0: CPU-friendly)
    in_all_gpu: bool = True  # a one-GPU suite that all-gpu runs


SUITES: dict[str, Suite] = {
    "decode-speed": Suite("W1 decode of the 3B and 1B shapes: overlapped / synchronous / FP8 / int4; the 8B "
                          "shape in bf16 and int4; batch sweeps", decode_speed_rows, 1),
    "speculation": Suite("demo pair T=0/1, n-gram on W5 and W1, suffix decoding on W5 and the agent workload, a "
                         "random 1B draft on the 3B shape",
                         speculation_rows, 1),
    "costs": Suite("c and v(K) of the 1B draft for the 3B target, bf16, FP8 and int4 draft, of an EAGLE-3 "
                   "head and of Medusa heads (bf16, FP8); projections", costs_rows, 1),
    "w2": Suite("continuous vs static batching, prefix caching, prefill of 16 x 2,048 tokens (MFU)", w2_rows, 1),
    "tp": Suite("2 GPUs: 8B TP=2 vs TP=1, collectives a step, W2, the 3B shape with a 1B draft", tp_rows, 2),
    "smoke": Suite("each kind of measurement once on the demo pair (or --model), CPU-friendly", smoke_rows, 0),
    "acceptance-sweep": Suite("controlled acceptance (an oracle picks which drafts match; real costs): the 3B "
                              "shape with the 1B draft, bf16 and FP8, chains and trees, and with an EAGLE-3 head, "
                              "chains, at alpha 0.6..0.9; both at alpha 0.8 at batch 8, 16, 32, 64 and 128",
                              sweep_rows, 1, in_all_gpu=False),
    "serve": Suite("open-loop serving at Poisson request rates (ours, or --url), ShareGPT-like lengths: "
                   "throughput, TTFT / TPOT / E2E p50 and p99", serve_rows, 0, in_all_gpu=False),
    "all-gpu": Suite("the runs of record: every one-GPU suite's rows, in order", None, 1),
}


def build_table(options: HarnessOptions, serve: ServeSetup | None = None
                ) -> tuple[dict[str, Row], dict[str, list[str]]]:
    """(every row by name, each suite's selected row names). A row belongs to one suite
    (the copy bandwidth to none: it runs where a roofline needs it); all-gpu is computed.
    `serve`: what the serve suite sends, and where (default: ServeSetup())."""
    models = Models.from_options(options, serve)
    rows, owned = [bandwidth_row()], {}
    for name, suite in SUITES.items():
        if suite.rows is not None:
            mine = suite.rows(models)
            owned[name] = [r.name for r in mine]
            rows += mine
    owned["all-gpu"] = [r for name, suite in SUITES.items()
                        if suite.rows is not None and suite.gpus == 1 and suite.in_all_gpu for r in owned[name]]
    return index_rows(rows), owned


def suite_rows(name: str, options: HarnessOptions, serve: ServeSetup | None = None
               ) -> tuple[dict[str, Row], list[str]]:
    """The table and the rows suite `name` selects."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {sorted(SUITES)}")
    table, owned = build_table(options, serve)
    return table, owned[name]


def custom_rows(workload: Workload, overrides: dict, hf: bool) -> tuple[dict[str, Row], list[str]]:
    """`infer bench --workload ...`: the model's roofline, the engine run, optionally transformers."""
    model = overrides.get("model") or str(DEMO_TARGET)
    label = _label(model)
    roof = roofline_row(label, model)
    ours = engine_row(f"{workload.name}/{label}/ours", f"{workload.label} with the given engine flags",
                      workload.label, workload, overrides, {"roofline": roof.name})
    rows = [bandwidth_row(), roof, ours]
    if hf:
        rows.append(hf_row(f"{workload.name}/{label}/hf", "transformers generate, same weights", workload.label,
                           workload, HFPeer(model, load_format=overrides.get("load_format", "auto")),
                           {"roofline": roof.name, "baseline": ours.name}))
    return index_rows(rows), [r.name for r in rows]
