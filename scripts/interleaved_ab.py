"""Step-interleaved A/B on a batch workload (W2, W2-prefix): the plain engine and the
variants run the same workload at the same time, taking turns of `--block` decode steps,
so the host's slow phases (the H100 hosts' generations read 0.058-0.103 ms a token within
one engine, run 21g) fall on every engine alike instead of on whichever generation ran then.

Each cycle adds the workload (fresh seeds) to every engine and steps them in turns until
all are done; the order rotates every cycle and reverses every other one. An engine's time
is the sum of its own turns (decode steps and the prefills among them). Its clocks are its
own too: `time.perf_counter` (what the engines time their steps, episodes and gaps with)
is replaced by a per-engine clock that stands still while other engines step, so an
adaptive engine's measurements see its own steps back to back, as when it runs alone.

Printed per workload and temperature: each engine's ratio to plain (the mean time of
plain's instances / its time, > 1 faster), pooled over the cycles (sums) with a 95 %
bootstrap interval over cycles, the median of the per-cycle ratios, the per-cycle ratios
themselves, and what a speculative engine did a cycle. Each plain instance's own ratio
(`--plain-instances 2`) is the method's noise floor. The tail of a cycle, after the faster
engines finished, runs alone: with engines far apart in speed it flatters the slower one a
little (its last steps run without the others' cache traffic).

    PYTHONPATH=src python scripts/interleaved_ab.py [--workload W2 W2-prefix] [--temperature 0 1]
        [--variants ngram-adaptive ngram-k5] [--cycles 20] [--block 4] [--plain-instances 2]
        [--split] [--episodes] [--gc] [--cpu-tiny]   (--split: each engine's time by step kind;
        --episodes: the speculative episodes by batch bucket; --gc: collections' pauses by engine;
        --cpu-tiny: the dev CPU, a tiny random model, drafting for itself in draft variants)

Why: issue #5's goal (adaptive never > 3 % slower than plain) could not be read from
generation-by-generation A/B on the GPU hosts: one configuration's instances spread by 20 %
and the 95 % intervals were +-15 % (runs 21a-21i, `scripts/plain_step_ab.py`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers (the CPU stand-in's checkpoint)
from plain_step_ab import BATCH_WORKLOADS, VARIANTS, _build, submit_workload, sync  # noqa: E402

import infer.spec.ngram as ngram_module  # noqa: E402
from infer.bench.workloads import WORKLOADS, PromptSet, build_requests  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402
from infer.engine.request import Request  # noqa: E402
from infer.spec.costs import batch_samples  # noqa: E402

REAL_CLOCK: Callable[[], float] = time.perf_counter


class EngineClocks:
    """A `perf_counter` per engine: real time less the time spent outside the engine's turns
    (`enter` .. `leave`); outside every turn, real time."""

    def __init__(self, real: Callable[[], float] = REAL_CLOCK) -> None:
        self.real = real
        self.behind: dict[str, float] = {}  # engine -> seconds its clock stood still
        self.left_at: dict[str, float] = {}  # engine -> real time its last turn ended
        self.active: str | None = None

    def __call__(self) -> float:
        return self.real() - (self.behind.get(self.active, 0.0) if self.active is not None else 0.0)

    def enter(self, name: str) -> None:
        now = self.real()
        if name in self.left_at:
            self.behind[name] = self.behind.get(name, 0.0) + now - self.left_at[name]
        self.active = name

    def leave(self) -> None:
        assert self.active is not None
        self.left_at[self.active] = self.real()
        self.active = None


def install(clocks: EngineClocks) -> Callable[[], None]:
    """Make `clocks` the `perf_counter` the engines read; returns the undo."""
    saved = time.perf_counter, ngram_module.perf_counter
    time.perf_counter = ngram_module.perf_counter = clocks  # type: ignore[assignment]

    def undo() -> None:
        time.perf_counter, ngram_module.perf_counter = saved

    return undo


# engine -> step kind -> [seconds, steps]: `--split`'s ledger
Split = dict[str, dict[str, list[float]]]


def step_kind(prefill: object, decode: object) -> str:
    """What a step ran: prefill chunks (decodes beside them or not), or decodes alone by batch size."""
    if prefill:
        return "prefill"
    n = len(decode)  # type: ignore[arg-type]
    return "decode 17-32" if n > 16 else "decode 9-16" if n > 8 else "decode 1-8"


def why_not_quiet(runner: object, decode: Sequence[Request]) -> str:
    """Before a decode step outside a stretch: why the adaptive policy's standing all-plain
    decision does not cover it ("none": no decision stands, "-nocost" with no plain cost
    known at this batch size; "until": it ran out, a probe or refresh due; "version": a
    cost was measured; "batch": the batch is not its; "ok": it does, "-nocost" or
    "-resample" where the step is then a timed plain step)."""
    policy = runner.policy  # type: ignore[attr-defined]
    quiet = getattr(policy, "_quiet", None)
    if not hasattr(policy, "_quiet"):
        return ""
    if quiet is None:
        return "none" + ("" if policy.costs.has_plain(len(decode), batch_samples(decode)) else "-nocost")
    if not policy._steps + 1 < quiet.until:
        return "until" + (" vetoed" if quiet.vetoed else "")
    if quiet.version != policy.costs.version:
        return "version"
    if list(decode) != quiet.batch:
        return "batch"
    # it does: then the step is a timed plain step (no plain cost fresh here; a resample due)
    if not policy.costs.has_plain(len(decode), batch_samples(decode)):
        return "ok-nocost"
    resample = getattr(sys.modules[type(runner).__module__], "PLAIN_RESAMPLE_EVERY", None)
    if resample is not None and runner._plain_steps + 1 - runner._plain_sampled_at >= resample:  # type: ignore[attr-defined]
        return "ok-resample"
    return "ok"


def how(runner: object, stretch: bool | None, drafts_before: int | None) -> str:
    """A speculative runner's decode step: in a plain stretch (`stretch`), a round (drafts
    were verified), or another step (a choice, a timed or boundary plain step); "" for the
    plain runner."""
    if stretch is None:
        return ""
    if stretch:
        return " stretch"
    return " round" if runner.stats.drafts != drafts_before else " other"  # type: ignore[attr-defined]


def file_steps(engines: dict[str, Engine], split: Split, reasons: dict[str, dict[str, Counter]]) -> None:
    """Each engine's steps timed one by one into `split` by their kind (a wrapper on the
    runner's `step`; the time is the engine's `step` around it, scheduling and retirement in)."""
    for name, engine in engines.items():
        runner, ledger = engine.runner, split.setdefault(name, {})
        outer = engine.step
        whys = reasons.setdefault(name, defaultdict(Counter))

        def timed(runner=runner, outer=outer, ledger=ledger, whys=whys) -> object:  # noqa: ANN001
            kind: list[str] = []
            inner = runner.step

            def noted(prefill, decode):  # noqa: ANN001, ANN202
                # (a speculative runner's; not one whose class was made the plain runner's, *-asplain)
                stretch = runner._stretch.active if hasattr(type(runner), "_stretch_done") else None
                drafts = runner.stats.drafts if stretch is not None else None
                why = why_not_quiet(runner, decode) if stretch is False and decode and not prefill else ""
                out = inner(prefill, decode)
                kind.append(step_kind(prefill, decode) + ("" if prefill else how(runner, stretch, drafts)))
                if why:
                    whys[kind[-1]][why] += 1
                return out

            runner.step = noted
            start = REAL_CLOCK()
            try:
                return outer()
            finally:
                seconds = REAL_CLOCK() - start
                del runner.step  # (the instance attribute hid the class's method)
                entry = ledger.setdefault(kind[0] if kind else "idle", [0.0, 0])
                entry[0] += seconds
                entry[1] += 1

        engine.step = timed


def print_split(split: Split, plain: list[str], label: str, cycles: int) -> None:
    """A line an engine: its time a cycle by step kind, steps a cycle, microseconds a step,
    and the excess over as many of plain's steps at that batch size (plain's mean step
    there; rounds emit more tokens a step, so their excess is no loss by itself)."""
    pooled: dict[str, list[float]] = {}
    for p in plain:
        for k, (s, n) in split[p].items():
            entry = pooled.setdefault(k, [0.0, 0])
            entry[0] += s
            entry[1] += n
    base = {k: s / n for k, (s, n) in pooled.items() if n}
    for name, ledger in split.items():
        parts = []
        for k in sorted(ledger):
            s, n = ledger[k]
            bucket = k.split(" round")[0].split(" stretch")[0].split(" other")[0]
            excess = f"; {(s - n * base[bucket]) / cycles * 1e3:+.2f} ms" if bucket in base and name not in plain else ""
            parts.append(f"{k}: {s / cycles * 1e3:.1f} ms ({n / cycles:.1f} steps, {s / n * 1e6:.0f} us{excess})")
        print(f"{label} {name} a cycle: " + "; ".join(parts), flush=True)


# engine -> the speculative episodes it ended: `--episodes`' log
Episodes = dict[str, list[dict]]


def log_episodes(engines: dict[str, Engine], log: Episodes) -> None:
    """Each speculative engine's episodes (spec/episodes.py) into `log` as they end: batch
    size, predicted gain, steps, seconds against its plain baseline there, tokens, what the
    policy's calibration heard (`outcome`) and kappa after it; a wrapper on `_end_episode`."""
    for name, engine in engines.items():
        runner = engine.runner
        if not hasattr(runner, "_end_episode"):
            continue
        inner, entries = runner._end_episode, log.setdefault(name, [])

        def ending(runner=runner, inner=inner, entries=entries) -> None:  # noqa: ANN001
            episode = runner._episode
            if episode is not None:
                plain = runner.cost_model.step_seconds(episode.batch_size, 0, episode.sampled)
                outcome = episode.outcome(plain)
                entries.append(dict(b=episode.batch_size, sampled=episode.sampled, gain=episode.gain,
                                    steps=episode.steps, seconds=episode.seconds, tokens=episode.tokens,
                                    mixed=episode.mixed, plain=plain, outcome=outcome))
            inner()
            calibration = getattr(runner.policy, "calibration", None)
            if episode is not None and calibration is not None:
                entries[-1]["kappa"] = calibration.factor((runner.cost_model.bucket(episode.batch_size),
                                                           episode.sampled))

        runner._end_episode = ending


def print_episodes(log: Episodes, label: str, cycles: int) -> None:
    """Per engine and batch bucket: episodes a cycle, their steps, the plain steps of time
    they took and the tokens a request they emitted (realized: one a plain step is plain
    decoding's pace), predicted, the loss in plain steps (time less tokens), and the five
    dearest episodes."""
    for name, entries in log.items():
        by_bucket: dict[str, list[dict]] = defaultdict(list)
        for e in entries:
            by_bucket[step_kind((), range(e["b"]))].append(e)
        for bucket, es in sorted(by_bucket.items()):
            told = [e for e in es if e["outcome"] is not None]
            time_steps = sum(e["outcome"][0] for e in told)
            realized = sum(e["outcome"][1] for e in told)
            predicted = sum(e["outcome"][2] for e in told)
            print(f"{label} {name} episodes at {bucket}: {len(es) / cycles:.1f} a cycle ({len(told)} told), "
                  f"{sum(e['steps'] for e in es) / cycles:.1f} steps a cycle; told: {time_steps:.1f} plain steps "
                  f"of time, {realized:.1f} realized, {predicted:.1f} predicted, loss {time_steps - realized:+.1f} "
                  f"plain steps", flush=True)
            for e in sorted(told, key=lambda e: e["outcome"][1] - e["outcome"][0])[:5]:
                t, r, p = e["outcome"]
                print(f"{label} {name}   b {e['b']} gain {e['gain']:.2f} steps {e['steps']} {e['seconds'] * 1e3:.1f} ms "
                      f"= {t:.1f} plain steps, realized {r:.1f}, predicted {p:.1f}, kappa after "
                      f"{e.get('kappa', 1.0):.2f}", flush=True)


class GcTimes:
    """Garbage collections' pauses by the engine whose turn they fell in (`gc.callbacks`)."""

    def __init__(self, clocks: EngineClocks) -> None:
        self.clocks = clocks
        self.seconds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = REAL_CLOCK()
            return
        who, gen = self.clocks.active or "(between turns)", info["generation"]
        self.seconds[who][gen] += REAL_CLOCK() - self._start
        self.counts[who][gen] += 1

    def report(self, label: str, cycles: int, names: Sequence[str]) -> None:
        for who in [*names, *sorted(set(self.seconds) - set(names))]:
            s, n = self.seconds[who], self.counts[who]
            print(f"{label} gc in {who}'s turns a cycle: " + ", ".join(
                f"gen{g} {n[g] / cycles:.1f} x {s[g] / max(1, n[g]) * 1e6:.0f} us" for g in range(3))
                + f" = {sum(s) / cycles * 1e3:.2f} ms", flush=True)
        self.reset()

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()


def cycle(engines: dict[str, Engine], order: list[str], work: PromptSet, temperature: float, seed: int,
          block: int, clocks: EngineClocks) -> dict[str, float]:
    """One run of the workload on every engine at once, in turns of `block` steps; each
    engine's seconds."""
    for name in order:
        clocks.enter(name)
        submit_workload(engines[name], work, temperature, seed)
        clocks.leave()
    spent = dict.fromkeys(order, 0.0)
    live = list(order)
    while live:
        for name in list(live):
            engine = engines[name]
            clocks.enter(name)
            start = REAL_CLOCK()
            for _ in range(block):
                engine.step()
                if not engine.has_unfinished():
                    live.remove(name)
                    break
            sync()
            spent[name] += REAL_CLOCK() - start
            clocks.leave()
    return spent


def interval(plain: list[float], other: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % bootstrap interval of sum(plain) / sum(other) over cycles."""
    rng = random.Random(seed)
    n, values = len(plain), []
    for _ in range(resamples):
        picked = [rng.randrange(n) for _ in range(n)]
        values.append(sum(plain[i] for i in picked) / sum(other[i] for i in picked))
    values.sort()
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def report(times: dict[str, list[float]], plain_names: list[str], label: str, tokens: int,
           stats: dict[str, object]) -> None:
    cycles = len(times[plain_names[0]])
    # the reference: plain's instances pooled (identical engines in one process differ by
    # 1-2 %: one instance as the reference biases every ratio by its own effect)
    plain = [statistics.fmean(times[p][i] for p in plain_names) for i in range(cycles)]
    print(f"{label}: {cycles} cycles, plain ({len(plain_names)} instances) {sum(plain) / cycles / tokens * 1e3:.4f} "
          f"ms a token", flush=True)
    for name, ts in times.items():
        if len(plain_names) == 1 and name in plain_names:
            continue
        ratios = [p / x for p, x in zip(plain, ts, strict=True)]
        low, high = interval(plain, ts)
        line = (f"{label} {name}: x{sum(plain) / sum(ts):.3f} of plain (95% x{low:.3f}-x{high:.3f}; "
                f"median cycle x{statistics.median(ratios):.3f}), {sum(ts) / cycles / tokens * 1e3:.4f} ms a token")
        if name in stats:
            d = stats[name]
            line += (f"; a cycle {d.drafts / cycles:.1f} rounds, {d.draft_tokens / cycles:.1f} drafted, "
                     f"{d.accepted_tokens / cycles:.1f} accepted")
        print(line, flush=True)
        print(f"{label} {name} cycles: " + " ".join(f"{r:.3f}" for r in ratios), flush=True)


def print_ledgers(engines: dict[str, Engine], label: str) -> None:
    """Each adaptive engine's loss ledger (spec/loss_ledger.py): the locks taken so far, the
    keys locked now (bucket, sampled: the policy step their lock ends at) and each key's net
    loss in ms (negative: a gain)."""
    for name, engine in engines.items():
        policy = getattr(engine.runner, "policy", None)
        ledger = getattr(policy, "ledger", None)
        if ledger is None:
            continue
        now = policy._steps
        locked = {key: ledger.lock_end(key) for key in ledger.locked_keys(now)}
        losses = {key: round(lost * 1e3, 2) for key, lost in sorted(ledger._loss.items())}
        print(f"{label} {name} loss ledger: {ledger.locks_taken} locks, step {now}, locked {locked}, "
              f"elapsed {ledger.elapsed * 1e3:.0f} ms, net loss (ms) {losses}", flush=True)


def build(variants: Sequence[str], workloads: Sequence[str], plain_instances: int, cpu_tiny: bool,
          tmp: Path) -> dict[str, Engine]:
    """Plain's instances ("plain", "plain#1", ...) and the variants, built for the largest of
    `workloads`' batches; on the CPU with a tiny random checkpoint written under `tmp` if
    `cpu_tiny`."""
    batch = max(WORKLOADS[w].num_requests for w in workloads)
    options: dict[str, object] = {}
    if cpu_tiny:
        from host_steps_cpu import tiny_checkpoint
        tiny = str(tiny_checkpoint(tmp))
        options = dict(model=tiny, draft_model=tiny, use_cuda_graphs=False)  # (the draft variants' too)
    engines: dict[str, Engine] = {}
    for i in range(plain_instances):
        engines[f"plain#{i}" if i else "plain"] = _build((), batch, **options)["plain"]
    built = _build(tuple(variants), batch, **options)
    engines.update({name: built[name] for name in variants})
    return engines


def one_workload_args(ap: argparse.ArgumentParser, variant_help: str) -> argparse.Namespace:
    """Parse the arguments of a script that runs one variant on one batch workload
    (scripts/boundary_steps.py, scripts/profile_pair.py): the variant, `--temperature`,
    `--workload`, `--cpu-tiny` (one torch thread then), and the script's own already in `ap`."""
    ap.add_argument("variant", help=variant_help)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--workload", default="W2", choices=BATCH_WORKLOADS)
    ap.add_argument("--cpu-tiny", action="store_true", help="a tiny random model on the CPU (its own draft model)")
    args = ap.parse_args()
    if args.cpu_tiny:
        torch.set_num_threads(1)
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=["W2"], choices=BATCH_WORKLOADS)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--variants", nargs="+", default=["ngram-adaptive"],
                    choices=[v for v in VARIANTS if v != "plain"])
    ap.add_argument("--cycles", type=int, default=20, help="timed cycles per workload and temperature")
    ap.add_argument("--warm-up", type=int, default=1, help="untimed cycles first (graphs, tables, costs)")
    ap.add_argument("--block", type=int, default=4, help="decode steps an engine takes per turn")
    ap.add_argument("--plain-instances", type=int, default=2, help="the second shows the method's noise floor")
    ap.add_argument("--cpu-tiny", action="store_true", help="a tiny random model on the CPU (harness check)")
    ap.add_argument("--split", action="store_true",
                    help="also time every step and file it by kind (prefill; decode by batch size), a line an engine")
    ap.add_argument("--episodes", action="store_true",
                    help="log the speculative episodes (by batch bucket: time, realized and predicted tokens)")
    ap.add_argument("--gc", action="store_true", help="garbage collections' pauses by the engine whose turn they hit")
    args = ap.parse_args()
    if args.cycles < 2 or args.block < 1 or args.plain_instances < 1:
        ap.error("need --cycles >= 2, --block >= 1 and --plain-instances >= 1")
    if args.cpu_tiny:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engines = build(args.variants, args.workload, args.plain_instances, args.cpu_tiny, Path(tmp))
        names = list(engines)
        plain_names = [n for n in names if n.startswith("plain")]
        clocks = EngineClocks()
        undo = install(clocks)
        gc_times = GcTimes(clocks) if args.gc else None
        if gc_times is not None:
            gc.callbacks.append(gc_times)
        episodes: Episodes = {}
        if args.episodes:
            log_episodes(engines, episodes)
        try:
            for w in args.workload:
                plain = engines[plain_names[0]]
                work = build_requests(WORKLOADS[w], plain.vocab_size, plain.tokenizer)
                for t in args.temperature:
                    for c in range(args.warm_up):
                        cycle(engines, names, work, t, 10_000 * (c + 1), args.block, clocks)
                    before = {n: copy.deepcopy(e.runner.stats) for n, e in engines.items() if hasattr(e.runner, "stats")}
                    times: dict[str, list[float]] = {n: [] for n in names}
                    split: Split = {}
                    reasons: dict[str, dict[str, Counter]] = {}
                    if args.split:
                        file_steps(engines, split, reasons)
                    for entries in episodes.values():
                        entries.clear()
                    if gc_times is not None:
                        gc_times.reset()
                    for c in range(args.cycles):
                        rotated = names[c % len(names):] + names[:c % len(names)]
                        spent = cycle(engines, rotated if c % 2 == 0 else rotated[::-1], work, t,
                                      100 * c, args.block, clocks)
                        for n, s in spent.items():
                            times[n].append(s)
                    stats = {n: engines[n].runner.stats.minus(b) for n, b in before.items()}
                    label = f"{w} T={t:g} block {args.block}"
                    report(times, plain_names, label, work.expected_output_tokens, stats)
                    print_ledgers(engines, label)
                    print_episodes(episodes, label, args.cycles)
                    if gc_times is not None:
                        gc_times.report(label, args.cycles, names)
                    if args.split:
                        print_split(split, plain_names, label, args.cycles)
                        for name, by_kind in reasons.items():
                            for k, counts in sorted(by_kind.items()):
                                print(f"{label} {name} {k} steps, why no standing plain decision covered them "
                                      f"(a cycle): " + ", ".join(f"{why} {n / args.cycles:.1f}"
                                                                 for why, n in counts.most_common()), flush=True)
                        for engine in engines.values():
                            del engine.step
        finally:
            undo()
            if gc_times is not None:
                gc.callbacks.remove(gc_times)
        for name, engine in engines.items():
            leaks = engine.runner.leak_report() if hasattr(engine.runner, "leak_report") else []
            if leaks:
                print(f"{name} holds after the last cycle: {leaks}", flush=True)


if __name__ == "__main__":
    main()
