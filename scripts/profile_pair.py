"""cProfile the plain engine and a variant on the same batch workload, generation by
generation in turns, and print each one's functions by own time, with calls a generation:
what the variant's steps run that plain decoding's do not (cProfile inflates Python-heavy
code; compare calls and the functions only one side has, not absolute times).

    PYTHONPATH=src python scripts/profile_pair.py VARIANT [--temperature 1] [--workload W2]
        [--generations 3] [--top 30] [--cpu-tiny]

Why: on the H100 (run 22j, W2 T=1) a speculative engine built as adaptive but decoding and
reserving through the plain runner's methods (`draft-adaptive-plainpath`) still read 0.980
of plain decoding, while a plain runner through the speculative runner's forward read
1.001: the cost is in the speculative engine's code around the decode step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path

from interleaved_ab import build, one_workload_args
from plain_step_ab import submit_workload

from infer.bench.workloads import WORKLOADS, PromptSet, build_requests
from infer.engine.engine import Engine


def generation(engine: Engine, work: PromptSet, temperature: float, seed: int) -> None:
    submit_workload(engine, work, temperature, seed)
    while engine.has_unfinished():
        engine.step()


def print_difference(profiles: dict[str, cProfile.Profile], variant: str, generations: int, top: int) -> None:
    """The functions whose own time differs most between the variant and plain (a
    generation's worth: calls and microseconds each side)."""
    sides = {name: pstats.Stats(profiles[name]).stats for name in ("plain", variant)}  # type: ignore[attr-defined]
    keys = set(sides["plain"]) | set(sides[variant])

    def own(name: str, key: tuple) -> tuple[float, float]:
        entry = sides[name].get(key)
        return (0.0, 0.0) if entry is None else (entry[1] / generations, entry[2] / generations * 1e6)

    rows = sorted(keys, key=lambda k: -abs(own(variant, k)[1] - own("plain", k)[1]))[:top]
    print(f"== own time, {variant} against plain (a generation: calls, us)")
    for key in rows:
        (pc, pt), (vc, vt) = own("plain", key), own(variant, key)
        print(f"{vt - pt:+9.0f} us  calls {pc:8.0f} -> {vc:8.0f}  {key[0].split('/src/')[-1]}:{key[1]}({key[2]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    args = one_workload_args(ap, "a variant of scripts/plain_step_ab.py, profiled against plain")
    with tempfile.TemporaryDirectory() as tmp:
        engines = build([args.variant], [args.workload], 1, args.cpu_tiny, Path(tmp))
        work = build_requests(WORKLOADS[args.workload], engines["plain"].vocab_size, engines["plain"].tokenizer)
        profiles = {name: cProfile.Profile() for name in engines}
        for g in range(2 + args.generations):
            for name, engine in engines.items():
                profile = profiles[name] if g >= 2 else None
                if profile is not None:
                    profile.enable()
                generation(engine, work, args.temperature, 100 * g)
                if profile is not None:
                    profile.disable()
        print_difference(profiles, args.variant, args.generations, args.top)
        for name, profile in profiles.items():
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out)
            print(f"== {name}: {stats.total_calls / args.generations:.0f} calls a generation, "
                  f"{stats.total_tt / args.generations * 1e3:.1f} ms a generation (profiled)")
            stats.sort_stats("tottime").print_stats(args.top)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)


if __name__ == "__main__":
    main()
