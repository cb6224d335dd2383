"""A randomized differential test of engine configurations (the long run of
tests/integration/test_engine_fuzz.py).

    PYTHONPATH=src:tests python -m helpers.fuzz --cases 3000 --seed 1 [--shrink] [--json out.json]
    PYTHONPATH=src:tests python -m helpers.fuzz --seed 1 --case 417 --shrink    # one case, its repro

Case i of seed S is `helpers.fuzz_cases.draw_case(S, i)`: a random engine configuration
and workload on tiny random models (helpers/fuzz_models.py), checked by
helpers/fuzz_checks.py against plain decoding, a rerun, rows alone, limits and leaks.
Failures are grouped by signature; `--shrink` reduces the first case of each group and
prints it as a script. `--avoid` leaves features out (helpers.fuzz_cases.FEATURES).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from helpers.fuzz_cases import FEATURES, Case, draw_case
from helpers.fuzz_checks import Failure, Plain, check_case, describe
from helpers.fuzz_models import FuzzModels
from helpers.fuzz_shrink import repro_source, shrink


@dataclass
class FailureClass:
    first: Case
    failure: Failure
    cases: list[int] = field(default_factory=list)
    repro: str | None = None


def repro_command(case: Case) -> str:
    avoid = f" --avoid {','.join(sorted(case.avoid))}" if case.avoid else ""
    return f"PYTHONPATH=src:tests python -m helpers.fuzz --seed {case.seed} --case {case.index}{avoid} --shrink"


def run(models: FuzzModels, seed: int, indices: range | list[int], avoid: frozenset[str] = frozenset(),
        log: bool = True) -> dict[str, FailureClass]:
    """Check every case; failures grouped by signature."""
    plain = Plain(models)
    classes: dict[str, FailureClass] = {}
    start = time.monotonic()
    for n, index in enumerate(indices, 1):
        case = draw_case(seed, index, avoid)
        failure = check_case(case, models, plain)
        if failure is not None:
            group = classes.setdefault(failure.signature, FailureClass(case, failure))
            group.cases.append(index)
            if log and len(group.cases) == 1:
                print(f"case {index}: {describe(case, failure)}\n  repro: {repro_command(case)}", flush=True)
        if log and n % 100 == 0:
            print(f"[{n} cases, {time.monotonic() - start:.0f} s, {sum(len(c.cases) for c in classes.values())} "
                  f"failing in {len(classes)} classes]", flush=True)
    return classes


def _report(classes: dict[str, FailureClass], total: int) -> dict[str, object]:
    failing = sum(len(c.cases) for c in classes.values())
    print(f"\n{total} cases, {failing} failing, {len(classes)} classes")
    for signature, group in sorted(classes.items(), key=lambda kv: -len(kv[1].cases)):
        print(f"\n== {signature}: {len(group.cases)} cases (first {group.first.index})\n"
              f"  repro: {repro_command(group.first)}")
        if group.repro:
            print("  shrunk:\n    " + group.repro.replace("\n", "\n    "))
    return {"cases": total, "failing": failing,
            "classes": [{"signature": s, "count": len(g.cases), "cases": g.cases, "detail": g.failure.detail,
                         "repro": g.repro} for s, g in classes.items()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100, help="cases to run, from --start")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--case", type=int, help="run this one case only")
    parser.add_argument("--avoid", default="", help=f"comma-separated features to leave out: {', '.join(FEATURES)}")
    parser.add_argument("--shrink", action="store_true", help="shrink the first case of each failure class")
    parser.add_argument("--models", default=None, help="where the tiny models are written (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    avoid = frozenset(a for a in args.avoid.split(",") if a)
    models = FuzzModels.build(args.models or tempfile.mkdtemp(prefix="infer-fuzz-"))
    indices = [args.case] if args.case is not None else range(args.start, args.start + args.cases)
    classes = run(models, args.seed, indices, avoid)
    if args.shrink:
        plain = Plain(models)
        for group in classes.values():
            small = shrink(group.first, group.failure, models, plain)
            found = describe(small, check_case(small, models, plain) or group.failure)
            group.repro = "".join(f"# {line}\n" for line in found.splitlines()) + repro_source(small)
    summary = _report(classes, len(indices))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if classes else 0


if __name__ == "__main__":
    sys.exit(main())
