"""Same-process A/B on the demo target: the plain ContinuousRunner against the
SpeculativeRunner that never speculates (K0: the runner's own cost), the adaptive policy
(n-gram with and without shadow drafts, draft model), fixed K=5, and plain decoding with
the sampling done eagerly after the decode graph or with index tensors built afresh every
step (both as before), on the bench's W1 and W5 prompts. Each round runs every engine
once, starting at a different engine and in reverse order every other round, so machine
drift hits all alike; "paired" is the median of per-round ratios to plain, "best" the
ratio of the fastest runs.

    PYTHONPATH=src python scripts/plain_step_ab.py [--rounds 15] [--temperature 0 1]
        [--workload W1 W5] [--variants ...] [--phases]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from infer import SamplingParams
from infer.bench.workloads import WORKLOADS, build_requests
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET


class NeverSpeculate:
    def choose(self, requests, seq_lens, max_seq_len, tokens_left):  # noqa: ANN001, ANN201
        return [0] * len(requests)

    def update(self, request_id, num_draft, num_accepted):  # noqa: ANN001, ANN201
        return None

    def no_proposal(self, request_id):  # noqa: ANN001, ANN201
        return None

    def release(self, request_id):  # noqa: ANN001, ANN201
        return None


def instrument(engine: Engine) -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Time the parts of each decode step of a speculative runner: policy, proposer, plain
    decode, verification, cost model; and count chosen K. Returns the timings and a
    function that removes the wrappers."""
    runner = engine.runner
    phases: dict[str, list[float]] = defaultdict(list)
    undo: list[tuple[object, str]] = []

    def timed(obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            phases[label].append(time.perf_counter() - start)
            if label == "choose":
                phases[f"k={max(out)}"].append(0.0)
            return out

        setattr(obj, attr, wrapper)
        undo.append((obj, attr))

    timed(runner.policy, "choose", "choose")
    timed(runner.policy, "no_proposal", "miss")
    timed(runner.proposer, "propose", "propose")
    timed(runner, "_verify", "verify")
    timed(runner, "_accept", "accept")
    timed(runner.cost_model, "observe", "observe")
    timed(runner, "_speculative_decode", "decode step")
    if runner.shadow is not None:
        timed(runner.shadow, "take", "shadow take")
        timed(runner.shadow, "check", "shadow check")

    def remove() -> None:
        for obj, attr in undo:
            delattr(obj, attr)  # the instance attribute hides the class's method

    return phases, remove


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms_per_token(engine: Engine, prompt: list[int], temperature: float, tokens: int) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
    engine.add_request(prompt, params)
    engine.step()  # prefill
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return (time.perf_counter() - start) / (tokens - 1) * 1e3


VARIANTS = ("plain", "plain-eager-sampling", "plain-fresh-indices", "ngram-K0", "ngram-k5", "ngram-adaptive", "ngram-adaptive-noshadow",
            "draft-K0", "draft-k5", "draft-adaptive", "ngram-adaptive-K0", "draft-adaptive-K0")


def fresh_indices(engine: Engine) -> None:
    """Index tensors built afresh every step and then copied into the graph's staging buffer,
    rows expanded from the block table every time (as before rows were kept per slot and
    indices filled in place)."""
    from infer.cache.view import layout_indices
    pool = engine.runner.cache_pool
    size = pool.block_size

    def rows(slot, start, end):  # noqa: ANN001, ANN202
        first = start // size
        blocks = torch.tensor(pool.block_table(slot)[first:-(-end // size)], dtype=torch.long)
        pos = torch.arange(start, end) - first * size
        return blocks[pos // size] * size + pos % size

    def indices(layout, context_width=None, out=None):  # noqa: ANN001, ANN202
        fresh = layout_indices(layout, rows, pool.scratch_row, context_width)
        if out is None:
            return fresh
        n = len(layout.slots)
        out.write_rows.fill_(pool.scratch_row)
        out.write_rows[:n * layout.width] = fresh.write_rows
        out.gather_rows[:n] = fresh.gather_rows
        out.q_pos[:n] = fresh.q_pos
        out.ctx_end[:n] = fresh.ctx_end
        return out

    pool.indices = indices


def eager_sampling(engine: Engine) -> None:
    """Plain decode steps sample eagerly after the forward (as before sampling was captured in
    the decode step's graph): the logits, then `logits_to_probs` and `sample_from_probs`."""
    runner = engine.runner

    def decode(requests):  # noqa: ANN001, ANN202
        from infer.cache.view import BatchLayout
        layout = BatchLayout.of([r.slot for r in requests], [r.num_computed_tokens for r in requests],
                                [1] * len(requests))
        logits = runner.forward(torch.tensor([[r.last_token_id] for r in requests]), layout, all_logits=False)
        for r in requests:
            r.num_computed_tokens += 1
        tokens = runner.sample(requests, logits)
        return [(r, runner.output.append(r, t)) for r, t in zip(requests, tokens, strict=True)]

    runner._decode = decode


def build_engines(variants: tuple[str, ...] = VARIANTS) -> dict[str, Engine]:
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024)
    ngram = dict(base, use_speculative_decoding=True, speculative_method="ngram", spec_length=5)
    draft = dict(base, use_speculative_decoding=True, draft_model=str(DEMO_DRAFT), spec_length=5)
    configs = {"plain": base, "plain-eager-sampling": base, "plain-fresh-indices": base, "ngram-K0": ngram, "ngram-k5": ngram,
               "ngram-adaptive": dict(ngram, spec_policy="adaptive"),
               "ngram-adaptive-noshadow": dict(ngram, spec_policy="adaptive"),
               "draft-K0": draft, "draft-k5": draft, "draft-adaptive": dict(draft, spec_policy="adaptive"),
               # built (and calibrated) as adaptive, then never speculating: the build apart from the policy
               "ngram-adaptive-K0": dict(ngram, spec_policy="adaptive"),
               "draft-adaptive-K0": dict(draft, spec_policy="adaptive")}
    engines = {name: Engine(EngineConfig(**configs[name])) for name in ("plain", *variants) if name in configs}
    for name in ("ngram-K0", "draft-K0", "ngram-adaptive-K0", "draft-adaptive-K0"):
        if name in engines:
            engines[name].runner.policy, engines[name].runner.shadow = NeverSpeculate(), None
    if "plain-eager-sampling" in engines:
        eager_sampling(engines["plain-eager-sampling"])
    if "plain-fresh-indices" in engines:
        fresh_indices(engines["plain-fresh-indices"])
    if "ngram-adaptive-noshadow" in engines:
        noshadow = engines["ngram-adaptive-noshadow"].runner
        noshadow.shadow, noshadow.policy.shadowed = None, False
    return engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--workload", nargs="+", default=["W1", "W5"], choices=["W1", "W5"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="engines to compare (plain is always there)")
    ap.add_argument("--phases", action="store_true", help="also time the phases of adaptive steps (extra runs)")
    args = ap.parse_args()
    engines = build_engines(tuple(args.variants))
    names = list(engines)
    plain = engines["plain"]
    for w in args.workload:
        prompt = build_requests(WORKLOADS[w], plain.vocab_size, plain.tokenizer).requests[0].prompt_ids
        for t in args.temperature:
            times: dict[str, list[float]] = {name: [] for name in engines}
            for engine in engines.values():
                ms_per_token(engine, prompt, t, args.tokens)  # warm-up
            before = {name: copy.deepcopy(e.runner.stats) for name, e in engines.items() if hasattr(e.runner, "stats")}
            for i in range(args.rounds):
                # rotated, and reversed every other round: no variant always follows the same one
                # (the engine run right after another was seen to pay for it, up to 5 %)
                rotated = names[i % len(names):] + names[:i % len(names)]
                for name in rotated if i % 2 == 0 else rotated[::-1]:
                    times[name].append(ms_per_token(engines[name], prompt, t, args.tokens))
            ref, best_ref = statistics.median(times["plain"]), min(times["plain"])
            for name, ts in times.items():
                med = statistics.median(ts)
                # the median of per-round ratios cancels drift of the machine between rounds
                paired = statistics.median(p / x for p, x in zip(times["plain"], ts, strict=True))
                print(f"{w} T={t:g} {name}: {med:.3f} ms/token (x{ref / med:.3f} of plain speed; paired x{paired:.3f}, "
                      f"best x{best_ref / min(ts):.3f}), runs " + " ".join(f"{x:.3f}" for x in ts), flush=True)
            for name, earlier in before.items():  # what the timed runs did, per generation
                d = engines[name].runner.stats.minus(earlier)
                print(f"{w} T={t:g} {name} per generation: {d.drafts / args.rounds:.1f} rounds, "
                      f"{d.draft_tokens / args.rounds:.1f} drafted, {d.accepted_tokens / args.rounds:.1f} accepted",
                      flush=True)
            if args.phases:
                print_phases(engines, prompt, w, t, args.tokens)
            for name, engine in engines.items():
                if name.endswith("adaptive"):
                    print_costs(f"{w} T={t:g} {name}", engine)


def print_costs(label: str, engine: Engine) -> None:
    """What the adaptive policy believes at batch 1: relative costs r(K), one draft step,
    the calibrated forward's share of a real plain step, and the measured step times."""
    costs = engine.runner.cost_model
    plain = costs.step_seconds(1, 0)
    print(f"{label} costs: r(K) {[round(x, 2) for x in costs.relative_costs(1)]}, draft step "
          f"{costs.draft_step(1):.3f}, forward share {costs._forward_share(1, plain):.3f}, "
          f"measured ms {dict(sorted((k, round(v * 1e3, 3)) for (b, k), v in costs.observed.items() if b == 1))}",
          flush=True)


def print_phases(engines: dict[str, Engine], prompt: list[int], w: str, t: float, tokens: int) -> None:
    """Per-phase breakdown from extra, instrumented generations (the wrappers cost host time
    themselves, so the timed rounds run without them)."""
    for name, engine in engines.items():
        if not name.endswith(("adaptive", "noshadow")):
            continue
        phases, remove = instrument(engine)
        ms_per_token(engine, prompt, t, tokens)
        remove()
        print(f"{w} T={t:g} {name} per step (instrumented): " + ", ".join(
            f"{k} {statistics.fmean(v) * 1e3:.3f} ms x{len(v)}" for k, v in sorted(phases.items()) if v), flush=True)

if __name__ == "__main__":
    main()
