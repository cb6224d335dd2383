"""Compare training recipes of the demo pair on one GPU, then pack the best pair like gpu_run.sh.

Stage 1 trains one target per `--target NAME=ARGS` recipe, all at once on the same GPU (the
models are small, so several processes share it), and ranks them by their best validation
loss. Stage 2 distils a draft from the best target for every `--draft NAME=ARGS` recipe,
and from the second-best target with the first draft recipe, again in parallel, each
followed by the full evaluation (`python -m demo_pair --models draft`). The pair kept is
the one that meets the targets of the demo pair (alpha(T=1) >= --min-alpha, greedy agreement
>= --min-agreement, draft validation loss - target validation loss >= --min-gap) with the
lowest target validation loss; failing that, the one closest to meeting them. It is packed
into OUT exactly as gpu_run.sh packs a run (install it with install_results.sh); every
run's logs and results go to OUT/sweep_logs.tar.gz and a table to OUT/sweep.log.

Only the standard library: it drives `python -m demo_pair...` in subprocesses.

    python3 scripts/demo_pair/sweep.py --out "$OUT" \\
        --target "d3=--target-set dropout=0.3" --target "d3wd5=--target-set dropout=0.3 \\
        --target-set weight_decay=0.5" --draft "e12=" --draft "e16=--draft-epochs 16"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Job:
    """One training process: its name, directory and command."""

    name: str
    work: Path
    argv: list[str]
    log: Path = field(init=False)
    returncode: int | None = None

    def __post_init__(self) -> None:
        self.log = self.work / "console.log"


def parse_recipes(items: list[str], flag: str) -> list[tuple[str, list[str]]]:
    """["name=args", ...] -> [(name, argv)]; names must be unique letters, digits, _ or -."""
    recipes = []
    for item in items:
        name, sep, args = item.partition("=")
        if not sep or not name or not all(c.isalnum() or c in "_-" for c in name):
            raise ValueError(f"{flag} {item!r} must be NAME=ARGS with NAME of letters, digits, _ or -")
        recipes.append((name, shlex.split(args)))
    if len({n for n, _ in recipes}) != len(recipes):
        raise ValueError(f"{flag} names must be unique")
    return recipes


def run_parallel(jobs: list[Job], limit_s: float) -> None:
    """Start all jobs, wait for them up to limit_s in total, kill the ones still running."""
    env = {**os.environ, "PYTHONPATH": "src:scripts", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "3", "RAYON_NUM_THREADS": "3"}
    procs = []
    for job in jobs:
        job.work.mkdir(parents=True, exist_ok=True)
        with job.log.open("w") as fh:
            fh.write("$ " + shlex.join(job.argv) + "\n")
        procs.append(subprocess.Popen(job.argv, stdout=job.log.open("a"), stderr=subprocess.STDOUT,
                                      env=env))
    deadline = time.monotonic() + limit_s
    for job, proc in zip(jobs, procs, strict=True):
        try:
            job.returncode = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            job.returncode = proc.wait()
            with job.log.open("a") as fh:
                fh.write(f"\n[sweep] killed after the {limit_s:.0f} s limit\n")


def best_target_loss(work: Path) -> float | None:
    """The lowest validation loss of the target trained in `work` (None if it did not finish)."""
    path = work / "models" / "target" / "training_summary.json"
    if not path.is_file():
        return None
    valid = json.loads(path.read_text(encoding="utf-8"))["log"]["valid"]
    return min(row["loss"] for row in valid) if valid else None


def pair_row(name: str, target: str, draft: str, work: Path) -> dict[str, Any]:
    """The headline numbers of one evaluated pair (only names when it did not finish)."""
    row: dict[str, Any] = {"pair": name, "target_recipe": target, "draft_recipe": draft}
    path = work / "logs" / "eval_results.json"
    if path.is_file():
        r = json.loads(path.read_text(encoding="utf-8"))
        row.update(target_loss=r["target"]["loss"], draft_loss=r["draft"]["loss"],
                   gap=r["draft"]["loss"] - r["target"]["loss"],
                   alpha=r["draft_vs_target"]["alpha"],
                   agreement=r["draft_vs_target"]["greedy_agreement"],
                   bigram_alpha=r["bigram_vs_target"]["alpha"])
    return row


def shortfall(row: dict[str, Any], a: argparse.Namespace) -> float:
    """How far a pair is from the demo pair's targets (0: meets all of them)."""
    if "alpha" not in row:
        return float("inf")
    return (max(a.min_alpha - row["alpha"], 0.0) + max(a.min_agreement - row["agreement"], 0.0)
            + max(a.min_gap - row["gap"], 0.0))


def choose(rows: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any] | None:
    """The pair that meets the targets with the lowest target loss, else the closest one."""
    done = [r for r in rows if "alpha" in r]
    if not done:
        return None
    return min(done, key=lambda r: (shortfall(r, a), r["target_loss"], -r["agreement"]))


def header(python: str) -> str:
    """GPU and software versions, as gpu_run.sh prints them."""
    lines = []
    for cmd in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                [python, "-c", ("import sys, torch, tokenizers; print(sys.version); "
                                "print('torch', torch.__version__, 'tokenizers', tokenizers.__version__)")]):
        try:
            lines.append(subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip())
        except OSError as exc:
            lines.append(f"{cmd[0]}: {exc}")
    return "\n".join(lines) + "\n"


def stage_targets(a: argparse.Namespace, recipes: list[tuple[str, list[str]]]) -> list[tuple[float, str]]:
    """Train every target recipe at once; (best validation loss, name), best first."""
    jobs = [Job(f"t_{name}", a.work / f"t_{name}",
                [a.python, "-m", "demo_pair.train", "--out", str(a.work / f"t_{name}" / "models"),
                 "--log-dir", str(a.work / f"t_{name}" / "logs"), "--models", "target", "--seed",
                 str(a.seed), *args]) for name, args in recipes]
    start = time.monotonic()
    run_parallel(jobs, a.limit)
    print(f"[sweep] stage 1 ({len(jobs)} targets) took {time.monotonic() - start:.0f} s", flush=True)
    ranked = []
    for name, _ in recipes:
        loss = best_target_loss(a.work / f"t_{name}")
        print(f"[sweep] target {name}: best validation loss {loss}", flush=True)
        if loss is not None:
            ranked.append((loss, name))
    return sorted(ranked)


def stage_drafts(a: argparse.Namespace, ranked: list[tuple[float, str]],
                 drafts: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """Distil and evaluate drafts: every draft recipe from the best target, the first one
    from the second-best target; returns one row per pair."""
    plan = [(ranked[0][1], d) for d in drafts] + [(t, drafts[0]) for _, t in ranked[1:1 + a.second]]
    jobs, meta = [], []
    for target, (dname, dargs) in plan:
        pair = f"p_{target}_{dname}"
        work = a.work / pair
        shutil.copytree(a.work / f"t_{target}" / "models" / "target", work / "models" / "target")
        shutil.copytree(a.work / f"t_{target}" / "logs", work / "logs")
        jobs.append(Job(pair, work, [a.python, "-m", "demo_pair", "--out", str(work / "models"),
                                     "--log-dir", str(work / "logs"), "--models", "draft",
                                     "--seed", str(a.seed), *dargs]))
        meta.append((pair, target, dname, work))
    start = time.monotonic()
    run_parallel(jobs, a.limit)
    print(f"[sweep] stage 2 ({len(jobs)} drafts) took {time.monotonic() - start:.0f} s", flush=True)
    return [pair_row(*m) for m in meta]


def pack(a: argparse.Namespace, chosen: dict[str, Any], head: str) -> None:
    """OUT/{target,draft}/*.safetensors, OUT/demo_pair_files.tar.gz (models/, logs/) and
    OUT/run.log of the chosen pair: the layout install_results.sh reads."""
    work = a.work / chosen["pair"]
    for role in ("target", "draft"):
        (a.out / role).mkdir(parents=True, exist_ok=True)
        for shard in sorted((work / "models" / role).glob("*.safetensors")):
            shutil.copy2(shard, a.out / role / shard.name)
    with tarfile.open(a.out / "demo_pair_files.tar.gz", "w:gz") as tar:
        for sub in ("models", "logs"):
            tar.add(work / sub, arcname=sub, filter=_no_weights)
    target_log = a.work / f"t_{chosen['target_recipe']}" / "console.log"
    text = head + target_log.read_text(encoding="utf-8") + (work / "console.log").read_text(encoding="utf-8")
    (a.out / "run.log").write_text(text, encoding="utf-8")


def _no_weights(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if info.name.endswith(".safetensors") else info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/demo_sweep"))
    p.add_argument("--target", action="append", required=True, metavar="NAME=ARGS")
    p.add_argument("--draft", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--second", type=int, default=1, help="also distil from the next N targets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=240.0, help="seconds per stage")
    p.add_argument("--min-alpha", type=float, default=0.65)
    p.add_argument("--min-agreement", type=float, default=0.70)
    p.add_argument("--min-gap", type=float, default=0.10)
    p.add_argument("--python", default=os.environ.get("PYTHON", "python3"))
    a = p.parse_args(argv)
    targets, drafts = parse_recipes(a.target, "--target"), parse_recipes(a.draft or ["default="], "--draft")
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    a.out.mkdir(parents=True, exist_ok=True)
    head = header(a.python)
    print(head, end="", flush=True)
    ranked = stage_targets(a, targets)
    rows = stage_drafts(a, ranked, drafts) if ranked else []
    chosen = choose(rows, a)
    summary = {"targets": [{"name": n, "best_valid_loss": v} for v, n in ranked], "pairs": rows,
               "chosen": chosen, "criteria": {"min_alpha": a.min_alpha, "min_agreement":
                                              a.min_agreement, "min_gap": a.min_gap}}
    print(json.dumps(summary, indent=1), flush=True)
    (a.work / "sweep_summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    with tarfile.open(a.out / "sweep_logs.tar.gz", "w:gz") as tar:
        tar.add(a.work, arcname="sweep", filter=_no_weights)
    if chosen is None:
        print("[sweep] no pair finished: nothing packed", flush=True)
        return 1
    pack(a, chosen, head)
    print(f"[sweep] packed {chosen['pair']} (shortfall {shortfall(chosen, a):.4f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
