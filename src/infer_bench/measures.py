"""Row constructors, one per measurement kind: what each kind runs and what it records.

The copy probe and the roofline, our engine on a workload, the peers (transformers,
gpt-fast), the costs c and v(K) at batch 1 and the paper's projection, batch sweeps beside
their bytes limit, prefill with its model FLOPs, a tensor-parallel step's collectives and the
controlled-acceptance sweep. docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from infer_bench.batch_sweep import batch_sweep
from infer_bench.collectives import profile_collectives
from infer_bench.engine_runner import default_dtype, free_memory, run_engine
from infer_bench.peers import HFPeer, run_hf
from infer_bench.roofline import copy_bandwidth, decode_roofline
from infer_bench.rows import Context, CudaDevices, GptFastCheckout, Measured, Module, Need, NoPeers, Outcome, Row
from infer_bench.results import SWEEP_KIND
from infer_bench.sweep import SweepSession, SweepSetup, lowest_ids_table
from infer_bench.theory import prefill_flops, projection_table, tree_projection
from infer_bench.workloads import Workload
from infer.engine.config import EngineConfig
from infer.engine.loading import load_models_for
from infer.engine.step_costs import StepCostConfig, measure_model_costs, weight_bytes
from infer.engine.threads import apply_cpu_threads
from infer.models.loading.loader import load_model

PAIRED_MIN_REPEATS = 15  # rounds of a paired measurement: spikes of 1.5x hit a few runs in 5
TRANSFORMERS = Module("transformers", "transformers>=4.45")
XGRAMMAR = Module("xgrammar", "xgrammar>=0.2.0")  # constrained (structured-output) rows
BANDWIDTH = "bandwidth"
PREFILL_KIND = "prefill"


def _ref(ctx: Context, name: str, what: str) -> Any:
    m = ctx.run.get(name)
    if m is None or not m.ok:
        raise RuntimeError(f"{what} needs the measurement {name!r}, which did not succeed in this run")
    return m


def bandwidth_row(name: str = BANDWIDTH) -> Row:
    return Row(name, "device-to-device copy bandwidth (the rooflines' denominator)", "bandwidth", "roofline",
               _bandwidth)


def _bandwidth(ctx: Context) -> Outcome:
    """The copy probe, with what it bounds: a GPU's memory; on a CPU a copy small enough to stay
    largely in the caches, so the rooflines of models about that size (the demo pair) are a
    cache-speed bound, and larger models, read from DRAM, stay well below it."""
    bw = copy_bandwidth(ctx.device)
    size = f"a {bw.probe_bytes >> 20} MiB copy"
    meaning = (f"GPU memory bandwidth ({size})" if ctx.device.type == "cuda" else
               f"CPU: {size}, largely in the caches: a cache-speed bound for models of about that size, "
               "above what DRAM gives larger ones")
    return {"meaning": meaning}, bw.to_dict()


def roofline_row(label: str, model: str, quantization: str | None = None, needs: tuple[Need, ...] = ()) -> Row:
    """Row "roofline/<label>[-<quantization>]": `model`'s weights as `quantization` stores them."""

    def run(ctx: Context) -> Outcome:
        bw = _ref(ctx, BANDWIDTH, "a roofline")
        dtype = default_dtype(ctx.device)
        meta, _ = load_model(model, dtype=dtype, device="meta", load_format="dummy", quantization=quantization)
        roof = decode_roofline(weight_bytes(meta), bw.metrics["bytes_per_s"])
        return {"model": model, "dtype": dtype, "quantization": quantization}, roof.to_dict()

    name = f"roofline/{label}" + (f"-{quantization}" if quantization else "")
    return Row(name, f"batch-1 decode roofline of {model}" + (f" in {quantization}" if quantization else ""),
               "roofline", "roofline", run, {"bandwidth": BANDWIDTH}, (*needs, Measured(BANDWIDTH)))


def engine_row(name: str, what: str, group: str, workload: Workload, overrides: Mapping[str, Any],
               refs: Mapping[str, str] | None = None, paired_with: Mapping[str, Any] | None = None,
               needs: tuple[Need, ...] = ()) -> Row:
    """An engine run of `workload` with EngineConfig `overrides`; with `paired_with` (the
    baseline's overrides) its timed runs alternate with a baseline engine's (at least
    PAIRED_MIN_REPEATS rounds) and "x baseline" is the paired ratio."""

    def run(ctx: Context) -> Outcome:
        o = ctx.options
        threads = {"threads": o.threads} if o.threads is not None else {}
        repeats = max(o.repeats, PAIRED_MIN_REPEATS) if paired_with is not None else o.repeats
        return run_engine(ctx.workload(workload), {**threads, **overrides}, device=str(ctx.device),
                          warmup_tokens=o.warmup_tokens, repeats=repeats,
                          paired_with=None if paired_with is None else {**threads, **paired_with},
                          paired_instances=o.paired_instances)

    return Row(name, what, "engine", group, run, dict(refs or {}), needs)


def hf_row(name: str, what: str, group: str, workload: Workload, peer: HFPeer,
           refs: Mapping[str, str] | None = None, needs: tuple[Need, ...] = ()) -> Row:
    """transformers `generate` on the same weights (skipped under --no-hf or without transformers)."""

    def run(ctx: Context) -> Outcome:
        return run_hf(ctx.workload(workload), peer, device=str(ctx.device), warmup_tokens=ctx.options.warmup_tokens)

    return Row(name, what, "hf", group, run, dict(refs or {}), (NoPeers(), TRANSFORMERS, *needs))


def gpt_fast_row(name: str, what: str, group: str, workload: Workload, model: str,
                 refs: Mapping[str, str] | None = None) -> Row:
    """gpt-fast's compiled decode on `model`'s shape (bench/gpt_fast.py), from --gpt-fast PATH."""

    def run(ctx: Context) -> Outcome:
        from infer_bench.gpt_fast import run_gpt_fast
        assert ctx.options.gpt_fast is not None
        return run_gpt_fast(Path(ctx.options.gpt_fast), model, ctx.workload(workload), device=str(ctx.device))

    return Row(name, what, "gpt-fast", group, run, dict(refs or {}), (CudaDevices(1), GptFastCheckout()))


def costs_row(name: str, what: str, target: str, draft: str | None, use_cuda_graphs: bool,
              draft_quantization: str | None = None, needs: tuple[Need, ...] = (),
              method: str = "draft_model", draft_vocab: int | None = None) -> Row:
    """c and v(K) of `target` (and `draft`: with method "eagle" / "eagle3" an EAGLE head, with
    "medusa" Medusa heads; a head's step is the slope of its chain rounds, `round_step_times`;
    a draft model's one pass), loaded by
    the engine's loader with its checks and timed on the CPU threads the engine would
    choose (or --threads). `draft_vocab`: the draft model's vocabulary reduced to that many
    ids (the lowest: which ones does not change a step's cost)."""

    def run(ctx: Context) -> Outcome:
        with tempfile.TemporaryDirectory() as tmp:
            table = None if draft_vocab is None else lowest_ids_table(target, draft_vocab, Path(tmp))
            config = EngineConfig(model=target, draft_model=draft, use_speculative_decoding=draft is not None,
                                  speculative_method=method, device=str(ctx.device), dtype=default_dtype(ctx.device),
                                  draft_quantization=draft_quantization, threads=ctx.options.threads,
                                  spec_draft_vocab=table)
            models = load_models_for(config, ctx.device)
        cfg = StepCostConfig(repeats=ctx.options.cost_repeats)
        try:
            threads = apply_cpu_threads(config.threads, ctx.device,
                                        sum(p.numel() for p in models.target.parameters()))
            graphs = use_cuda_graphs and ctx.device.type == "cuda"
            head = models.head if models.head is not None else models.medusa
            costs = measure_model_costs(models.target, models.draft, graphs, cfg, head)
        finally:
            del models
            free_memory()
        params = {"target": target, "draft": draft, "method": method, "dtype": config.dtype,
                  "draft_quantization": draft_quantization, "draft_vocab": draft_vocab,
                  "use_cuda_graphs": use_cuda_graphs, "device": str(ctx.device), "threads": threads,
                  "context_len": cfg.context_len, "max_seq_len": cfg.max_seq_len, "batch_size": 1}
        return params, costs.to_dict()

    return Row(name, what, "spec_costs", "spec-costs", run, {}, needs)


def projection_row(name: str, costs: str) -> Row:
    """The paper's projected speedups (and static trees') from the c and v(K) of row `costs`."""

    def run(ctx: Context) -> Outcome:
        m = _ref(ctx, costs, "a projection")
        if m.metrics.get("c") is None:
            raise RuntimeError(f"projection needs a draft's cost: {costs!r} measured no c")
        c, verify = m.metrics["c"], m.metrics["verify_ratio"]
        paper = projection_table(c)
        measured = projection_table(c, verify_costs=verify) if len(verify) > max(paper.ks) else None
        trees = tree_projection(c, verify) if measured else None
        return ({"costs": costs, "c": c},
                {"paper": paper.to_dict(), "measured_verify": measured.to_dict() if measured else None,
                 "trees": trees.to_dict() if trees else None})

    return Row(name, f"projected speedup for acceptance 0.6..0.9, K 1..8 and static trees, from {costs}",
               "projection", "spec-costs", run, {"costs": costs}, (Measured(costs),))


def batch_sweep_row(name: str, what: str, group: str, overrides: Mapping[str, Any],
                    batches: tuple[int, ...], prompt_len: int = 128, refs: Mapping[str, str] | None = None) -> Row:
    """Decode steps at each batch size after prompts of `prompt_len` tokens; compared with the
    copy bandwidth for its bytes limit (derived, when the bandwidth was measured), and with
    a `baseline` sweep's steps at the batch sizes both ran (`refs`)."""
    return Row(name, what, "batch_sweep", group,
               lambda ctx: batch_sweep(overrides, batches, prompt_len=prompt_len, device=str(ctx.device)),
               {"bandwidth": BANDWIDTH, **(refs or {})})


def prefill_row(name: str, what: str, group: str, workload: Workload, overrides: Mapping[str, Any]) -> Row:
    """`workload`'s prompts (all of one length, one output token each: a run's wall time is
    submission to every first token) on our engine, repeated like an engine row (the median
    run reported; --output-len does not apply), with the model FLOPs of that prefill."""
    lo, hi = workload.prompt_len
    if workload.output_len != (1, 1) or lo != hi or workload.shared_prefix_len or workload.kind != "text":
        raise ValueError(f"a prefill row needs prompts of one length, no shared prefix and outputs of 1 token; "
                         f"workload {workload.name} has prompt_len {workload.prompt_len}, output_len "
                         f"{workload.output_len}, shared_prefix_len {workload.shared_prefix_len}")

    def run(ctx: Context) -> Outcome:
        o = ctx.options
        threads = {"threads": o.threads} if o.threads is not None else {}
        params, metrics = run_engine(workload, {**threads, **overrides}, device=str(ctx.device),
                                     warmup_tokens=o.warmup_tokens, repeats=o.repeats)
        _, config = load_model(overrides["model"], device="meta", load_format="dummy")
        prompts = [lo] * workload.num_requests
        metrics.update(prompt_tokens=sum(prompts), model_flops=prefill_flops(config, prompts),
                       prefill_tokens_per_s=sum(prompts) / metrics["wall_s"])
        return params, metrics

    return Row(name, what, PREFILL_KIND, group, run)


def collectives_row(name: str, what: str, group: str, workload: Workload, overrides: Mapping[str, Any],
                    needs: tuple[Need, ...] = ()) -> Row:
    return Row(name, what, "collectives", group,
               lambda ctx: profile_collectives(ctx.workload(workload), overrides, device=str(ctx.device)),
               needs=needs)


def acceptance_sweep_rows(setup: SweepSetup) -> list[Row]:
    """The sweep's rows, in the order its session serves them: per draft quantization the
    costs (c and v(K); at batch 1 only), the plain baseline (before the first speculative
    row), then every shape at every alpha ("sweep/<label>[-fp8][-v32k]/<shape>/a<alpha>")."""
    n = setup.draft_vocab
    vocab = "" if not n else f"-v{n // 1024}k" if n % 1024 == 0 else f"-v{n}"  # (-v32k: 32,768 ids)
    plain = f"sweep/{setup.label}{vocab}/plain"
    with_costs = setup.costs and setup.batch_size == 1
    count = len(setup.draft_quantizations) * (with_costs + len(setup.shapes) * len(setup.alphas)) + 1
    session = SweepSession(setup, count)

    def row(name: str, what: str, kind: str, group: str, fn: Callable[[Context], Outcome],
            refs: Mapping[str, str] | None = None, needs: tuple[Need, ...] = ()) -> Row:
        def run(ctx: Context) -> Outcome:
            try:
                return fn(ctx)
            finally:
                session.finish_row()

        return Row(name, what, kind, group, run, dict(refs or {}), needs)

    rows: list[Row] = []
    for q in setup.draft_quantizations:
        tag = setup.label + (f"-{q}" if q else "") + vocab
        group = f"acceptance sweep (controlled acceptance): {setup.target} drafted by {setup.draft}" + (
            f" in {q}" if q else "")
        costs = f"sweep/{tag}/costs"
        if with_costs:
            rows.append(row(costs, f"c and v(K) of the sweep's models{f' (draft in {q})' if q else ''}", "spec_costs",
                            "spec-costs", lambda ctx, q=q: session.costs(ctx, q)))
        refs = {"baseline": plain, "costs": costs} if with_costs else {"baseline": plain}
        if not any(r.name == plain for r in rows):
            rows.append(row(plain, f"plain decoding of {setup.target}, the sweep's baseline and the oracle's "
                                   "greedy continuations", "engine", group, session.plain))
        for shape in setup.shapes:
            for alpha in setup.alphas:
                rows.append(row(f"sweep/{tag}/{shape.tag}/a{alpha:g}",
                                f"{shape.tag} at controlled acceptance {alpha:g}", SWEEP_KIND, group,
                                lambda ctx, q=q, s=shape, a=alpha: session.spec(ctx, q, s, a),
                                refs, tuple(Measured(r) for r in refs.values())))
    return rows
