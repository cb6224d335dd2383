"""The controlled-acceptance sweep: speculation timed at chosen acceptance rates.

Every cost stays real (target, draft or EAGLE-3 head, CUDA graphs, the engine's rounds)
while an oracle (bench/oracle.py) chooses which drafts match, so a speedup at acceptance
alpha is measured, not projected. One `SweepSession` serves a sweep's rows: the models load
once per draft quantization, then the costs, the plain baseline (the oracle's record) and
one speculative engine per shape, timed at each alpha. docs/benchmarks.md, "Method".
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer_bench.engine_runner import (TimedRun, config_record, default_dtype, engine_config, free_memory,
                                       request_metrics, slowest_steps, spec_metrics, spec_snapshot, timed_run)
from infer_bench.oracle import OracleProposer
from infer_bench.rows import Context, Outcome
from infer_bench.workloads import PromptSet, Workload, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import LoadedModels, load_draft, load_models_for, load_part
from infer.engine.request import Request
from infer.engine.step_costs import StepCostConfig, measure_model_costs
from infer.models.loading.loader import read_model_config
from infer.models.llama import LlamaForCausalLM
from infer.speculative.draft_vocab import lowest_ids
from infer.speculative.tree import TreeShape, chain_shape

# untimed runs of the workload before the timed ones: the first over fresh prompts, the second
# over their cached prefixes as every timed run after it (after one warm-up alone, a first
# timed run could take three times the next: docs/benchmarks.md)
WARMUP_RUNS = 2
CONTROLLED = ("controlled acceptance: an oracle (bench only) replaces the draft model's tokens so that each "
              "draft matches the target's greedy continuation with probability alpha; draft and target costs are real")
SWEEP_WORKLOAD = Workload("acceptance-sweep", 4, (128, 128), (64, 64), temperature=0.0,
                          description="4 prompts of 128 tokens, 64 new tokens each, served one at a time, T=0")


@dataclass(frozen=True)
class SweepShape:
    """A round's draft shape: a chain of K ("k3") or a static tree ("tree-2x2")."""

    tag: str
    branching: tuple[int, ...]

    @classmethod
    def chain(cls, k: int) -> SweepShape:
        return cls(f"k{k}", chain_shape(k).branching)

    @classmethod
    def tree(cls, text: str) -> SweepShape:
        shape = TreeShape.parse(text)
        return cls("tree-" + "x".join(map(str, shape.branching)), shape.branching)

    @property
    def is_chain(self) -> bool:
        return all(b == 1 for b in self.branching)

    def overrides(self) -> dict[str, Any]:
        """The EngineConfig fields that make an engine draft this shape."""
        k = len(self.branching)
        return {"spec_length": k} if self.is_chain else {"spec_tree": str(TreeShape(self.branching))}


@dataclass(frozen=True)
class SweepSetup:
    target: str
    draft: str
    label: str  # "<target>-<draft>", e.g. "3b-1b"
    shapes: tuple[SweepShape, ...]
    alphas: tuple[float, ...]
    draft_quantizations: tuple[str | None, ...] = (None, "fp8")
    workload: Workload = SWEEP_WORKLOAD
    use_cuda_graphs: bool = True
    calibration_requests: int = 1  # prompts of the alpha-0 run that times a round
    seed: int = 0
    method: str = "draft_model"  # speculative_method: "eagle3" / "eagle" with `draft` an EAGLE head
    batch_size: int = 1  # requests decoding at once (the engine's max_batch_size)
    batch_gate: bool = False  # spec_batch_gate: rounds timed against plain steps (off: every step drafts)
    costs: bool = True  # c and v(K) measured first (at batch 1 only)
    draft_vocab: int | None = None  # the draft model's vocabulary reduced to its lowest ids (spec_draft_vocab)

    def __post_init__(self) -> None:
        if not self.shapes or not self.alphas or not self.draft_quantizations:
            raise ValueError("an acceptance sweep needs at least one shape, one alpha and one draft quantization")
        if any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas are acceptance probabilities in [0, 1], got {self.alphas}")
        if self.workload.temperature != 0:
            raise ValueError(f"the oracle's acceptance is exact at temperature 0 only; the workload has "
                             f"temperature {self.workload.temperature}")
        if self.draft_vocab is not None and (self.method != "draft_model" or self.draft_vocab < 1):
            raise ValueError(f"draft_vocab reduces a draft model's vocabulary to >= 1 ids, got {self.draft_vocab} "
                             f"for method {self.method!r}")
        if self.method != "draft_model" and self.draft_quantizations != (None,):
            raise ValueError(f"an acceptance sweep of {self.method} heads has no draft quantization: pass "
                             "draft_quantizations=(None,)")
        if not 1 <= self.batch_size <= self.workload.num_requests:
            raise ValueError(f"batch_size must be in 1..{self.workload.num_requests} (the workload's requests), "
                             f"got {self.batch_size}")
        if not 1 <= self.calibration_requests <= self.workload.num_requests:
            raise ValueError(f"calibration_requests must be in 1..{self.workload.num_requests} (the workload's "
                             f"requests), got {self.calibration_requests}")

    @property
    def max_nodes(self) -> int:
        return max(TreeShape(s.branching).num_nodes for s in self.shapes)


class SweepSession:
    """The models, the current engine and the oracle's records shared by a sweep's rows."""

    def __init__(self, setup: SweepSetup, rows: int) -> None:
        self.setup = setup
        self.rows_left = rows  # the session frees everything after its last row
        self.records: list[list[int]] | None = None  # per prompt: prompt + greedy output
        self._models: LoadedModels | None = None
        self._quantization: str | None = None
        self._engine: Engine | None = None
        self._engine_key: tuple[str | None, str] | None = None
        self._oracle: OracleProposer | None = None
        self._zero: dict[str, Any] = {}  # the current engine's alpha-0 run
        self._vocab_dir: tempfile.TemporaryDirectory[str] | None = None  # the reduced vocabulary's table

    def finish_row(self) -> None:
        self.rows_left -= 1
        if self.rows_left <= 0:
            self.close()

    def close(self) -> None:
        self._drop_engine()
        self._models = None
        if self._vocab_dir is not None:
            self._vocab_dir.cleanup()
            self._vocab_dir = None
        free_memory()

    # -- rows ------------------------------------------------------------------------------------
    def costs(self, ctx: Context, quantization: str | None) -> Outcome:
        """c and v(K) of the session's models, K up to the largest shape's nodes."""
        models = self._load(ctx, quantization)
        wl = ctx.workload(self.setup.workload)
        context = wl.shared_prefix_len + wl.prompt_len[1] + wl.output_len[1] // 2
        cfg = StepCostConfig(context_len=context, max_seq_len=self._config(ctx, {}).max_seq_len,
                             k_max=self.setup.max_nodes, repeats=ctx.options.cost_repeats)
        graphs = self.setup.use_cuda_graphs and ctx.device.type == "cuda"
        costs = measure_model_costs(models.target, models.draft, graphs, cfg, models.head)
        params = {"target": self.setup.target, "draft": self.setup.draft, "method": self.setup.method,
                  "draft_quantization": quantization,
                  "use_cuda_graphs": graphs, "device": str(ctx.device), "context_len": cfg.context_len,
                  "max_seq_len": cfg.max_seq_len, "batch_size": 1}
        return params, costs.to_dict()

    def plain(self, ctx: Context) -> Outcome:
        """The baseline, and the records of the target's greedy continuations."""
        models = self._load(ctx, self._quantization if self._models else self.setup.draft_quantizations[0])
        config = self._config(ctx, {"use_speculative_decoding": False})
        capture, models.target.capture = models.target.capture, None  # (a head's features: not for plain steps)
        engine = Engine(config, dataclasses.replace(models, draft=None, head=None))
        models.target.capture = capture
        try:
            prompts = self._prompts(ctx, engine)
            runs = self._time(engine, ctx, prompts.requests, WARMUP_RUNS + ctx.options.repeats)
            records = [[_sequence(r) for r in run.requests] for run in runs]
            self.records = records[0]
            metrics = self._rates(runs[WARMUP_RUNS:], prompts)
            metrics.update(records_agree=all(r == records[0] for r in records), leaks=engine.leak_report())
            params = self._params(ctx, engine, prompts)
        finally:
            del engine
            free_memory()
        return params, metrics

    def spec(self, ctx: Context, quantization: str | None, shape: SweepShape, alpha: float) -> Outcome:
        engine, oracle = self._engine_for(ctx, quantization, shape)
        prompts = self._prompts(ctx, engine)
        oracle.set_alpha(alpha, f"{self.setup.seed}/{shape.tag}/{alpha}")
        before = spec_snapshot(engine)
        runs = self._time(engine, ctx, prompts.requests, ctx.options.repeats)
        after = spec_snapshot(engine)
        assert before is not None and after is not None
        metrics = self._rates(runs, prompts)
        metrics.update(spec_metrics(after.minus(before)))
        metrics.update(oracle.counts.to_dict())
        metrics["round_ms"] = _round_ms(metrics)
        clock = engine.runner.speculation.clock if engine.runner.speculation is not None else None
        metrics["gate"] = clock.report() if clock is not None and clock.gate else None  # (the batch gate's view)
        metrics.update(self._zero)
        metrics["leaks"] = engine.leak_report()
        params = self._params(ctx, engine, prompts)
        params.update(acceptance=CONTROLLED, alpha=alpha, shape=shape.tag, branching=list(shape.branching),
                      draft_quantization=quantization, oracle_seed=f"{self.setup.seed}/{shape.tag}/{alpha}")
        return params, metrics

    # -- parts -----------------------------------------------------------------------------------
    def _load(self, ctx: Context, quantization: str | None) -> LoadedModels:
        """The target once, the draft in `quantization` (reloaded when it changes)."""
        if self._models is not None and quantization == self._quantization:
            return self._models
        self._drop_engine()
        config = self._config(ctx, {"draft_quantization": quantization})
        if self._models is None:
            self._models = load_models_for(config, ctx.device)
            steady_greedy(self._models.target)
        else:
            self._models.draft = None
            free_memory()
            self._models.draft = load_draft(load_part(config, ctx.device), self._models.target,
                                            vocab_map=self._models.vocab_map, max_seq_len=config.max_seq_len)
        self._quantization = quantization
        return self._models

    def _engine_for(self, ctx: Context, quantization: str | None,
                    shape: SweepShape) -> tuple[Engine, OracleProposer]:
        key = (quantization, shape.tag)
        if self._engine is not None and self._oracle is not None and self._engine_key == key:
            return self._engine, self._oracle
        if self.records is None:
            raise RuntimeError("the acceptance sweep's plain row records the continuations the oracle needs: "
                               "run it first")
        models = self._load(ctx, quantization)
        self._drop_engine()
        start = time.perf_counter()
        engine = Engine(self._config(ctx, {"draft_quantization": quantization, **shape.overrides()}), models)
        built_s = time.perf_counter() - start
        speculation = engine.runner.speculation
        assert speculation is not None
        # the one place the benchmark reaches into the runner: the oracle wraps its proposer
        oracle = OracleProposer(speculation.proposer, self.records, engine.vocab_size, alpha=max(self.setup.alphas))
        speculation.proposer = oracle
        self._engine, self._engine_key, self._oracle = engine, key, oracle
        prompts = self._prompts(ctx, engine).requests
        self._time(engine, ctx, prompts, WARMUP_RUNS)
        oracle.set_alpha(0.0)
        clock = speculation.clock  # (the batch gate would stop rounds at zero acceptance: off meanwhile)
        gated = clock is not None and clock.gate
        if clock is not None:
            clock.gate = False
        before = spec_snapshot(engine)
        runs = self._time(engine, ctx, prompts[:self.setup.calibration_requests], 1)
        after = spec_snapshot(engine)
        if clock is not None:
            clock.gate = gated
        assert before is not None and after is not None
        zero = {**request_metrics(runs[0].requests, runs[0].wall), **spec_metrics(after.minus(before))}
        self._zero = {"round_ms_zero_acceptance": _round_ms(zero),
                      "tokens_per_round_zero_acceptance": zero.get("mean_accepted_length"),
                      "engine_build_s": built_s}  # (the models were loaded before)
        return engine, oracle

    def _drop_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = self._oracle = self._engine_key = None
        self._zero = {}
        free_memory()

    def _config(self, ctx: Context, overrides: Mapping[str, Any]) -> EngineConfig:
        s = self.setup
        threads = {"threads": ctx.options.threads} if ctx.options.threads is not None else {}
        values = {"model": s.target, "draft_model": s.draft, "speculative_method": s.method,
                  "use_speculative_decoding": True, "spec_batch_gate": s.batch_gate, "max_batch_size": s.batch_size,
                  "use_cuda_graphs": s.use_cuda_graphs and ctx.device.type == "cuda", **threads, **overrides}
        if not values["use_speculative_decoding"]:
            values.pop("draft_model")
            values.pop("speculative_method")
            values.pop("spec_batch_gate")
            values.pop("draft_quantization", None)
        elif s.draft_vocab is not None:
            values["spec_draft_vocab"] = self._vocab_table()
        return engine_config(ctx.workload(s.workload), values, str(ctx.device))

    def _vocab_table(self) -> str:
        """The reduced vocabulary's table (the target's lowest ids), in the session's folder."""
        assert self.setup.draft_vocab is not None
        if self._vocab_dir is None:
            self._vocab_dir = tempfile.TemporaryDirectory(prefix="infer-sweep-vocab-")
        return lowest_ids_table(self.setup.target, self.setup.draft_vocab, Path(self._vocab_dir.name))

    def _prompts(self, ctx: Context, engine: Engine) -> PromptSet:
        return build_requests(ctx.workload(self.setup.workload), engine.vocab_size, engine.tokenizer)

    def _time(self, engine: Engine, ctx: Context, specs: Sequence[Any],
              repeats: int) -> list[TimedRun]:
        return [timed_run(engine, ctx.workload(self.setup.workload), specs) for _ in range(repeats)]

    def _rates(self, runs: Sequence[TimedRun], prompts: PromptSet) -> dict[str, Any]:
        """The median run's rates, every run's wall time and slowest step."""
        median = sorted(runs, key=lambda run: run.wall)[len(runs) // 2]
        metrics = request_metrics(median.requests, median.wall)
        metrics.update(wall_s_runs=[r.wall for r in runs], expected_output_tokens=prompts.expected_output_tokens,
                       **slowest_steps(runs))
        # batch 1, requests one at a time: decode tokens/s; a batch: the run's output tokens/s
        metrics["primary_rate"] = metrics["decode_tokens_per_s" if self.setup.batch_size == 1 else "tokens_per_s"]
        return metrics

    def _params(self, ctx: Context, engine: Engine, prompts: PromptSet) -> dict[str, Any]:
        return {"workload": ctx.workload(self.setup.workload).to_dict(), "prompt_source": prompts.source,
                "engine": config_record(engine), "target": self.setup.target, "draft": self.setup.draft,
                "batch_size": self.setup.batch_size, "dtype": default_dtype(ctx.device)}


def steady_greedy(model: LlamaForCausalLM) -> None:
    """Zero every layer's o_proj and down_proj, so the residual stream is the token's
    embedding and greedy decoding does not depend on kernel rounding (module docstring)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.weight.zero_()


def _sequence(request: Request) -> list[int]:
    return list(request.prompt_token_ids) + list(request.output_token_ids)


def _round_ms(metrics: Mapping[str, Any]) -> float | None:
    """A round's time: tokens a round / decode tokens per second."""
    rate, tokens = metrics.get("decode_tokens_per_s"), metrics.get("mean_accepted_length")
    return tokens / rate * 1e3 if rate and tokens else None


def lowest_ids_table(target: str, size: int, directory: Path) -> str:
    """A reduced draft vocabulary's table of `target`'s `size` lowest ids, written to
    `directory`; its path (on dummy weights, which ids are kept does not change a step's cost)."""
    path = directory / "draft-vocab.json"
    lowest_ids(read_model_config(target).vocab_size, size).save(path)
    return str(path)
