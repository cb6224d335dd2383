"""`infer bench`: run a predefined suite or one workload, write JSON, print a summary.

    infer bench --suite decode-speed --out results/decode.json
    infer bench --suite smoke --list                 # the rows a suite runs; run nothing
    infer bench --workload W1 --model dummy:llama-3.2-3b --enforce-eager
    infer bench --report results/all.json            # Markdown tables for docs/benchmarks.md
    infer bench --plot results/all.json              # PNG charts in results/all-charts/
"""

from __future__ import annotations

import argparse
import fnmatch
import datetime as _dt
import sys
from pathlib import Path
from typing import Any

from infer_bench.harness import Harness, HarnessOptions
from infer_bench.report import console_table, markdown
from infer_bench.results import BenchRun, environment_info, load_run, save_run
from infer_bench.rows import with_refs
from infer_bench.serve import DEFAULT_RATES, FASTAPI, HTTPX, UVICORN, ServeSetup, parse_rates
from infer_bench.suites import SUITES, custom_rows, suite_rows
from infer_bench.workloads import WORKLOADS, get_workload
from infer.engine.args import add_engine_args, engine_config_from_args, engine_values
from infer.engine.loading import resolve_device


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to run")
    what.add_argument("--suite", choices=list(SUITES), help="a predefined suite: " + "; ".join(
        f"{name}: {suite.what}" for name, suite in SUITES.items()))
    what.add_argument("--list", action="store_true", help="--suite: print the rows it would run; run nothing")
    what.add_argument("--workload", choices=sorted(WORKLOADS), help="one workload with the engine flags below")
    what.add_argument("--temperature", type=float, default=0.0,
                      help="--workload: sampling temperature (default: %(default)s)")
    what.add_argument("--hf", action="store_true", help="--workload: also time transformers generate")
    what.add_argument("--report", nargs="+", metavar="JSON", help="print Markdown tables of result files; run nothing")
    what.add_argument("--plot", nargs="+", metavar="JSON", type=Path,
                      help="write PNG charts of result files (needs matplotlib); run nothing")
    what.add_argument("--plot-dir", type=Path, help="--plot: where the charts go (default: <file>-charts/)")
    serve = parser.add_argument_group("--suite serve")
    serve.add_argument("--url", help="benchmark this running OpenAI-compatible server (e.g. vLLM's) instead of "
                                     "starting ours on 127.0.0.1")
    serve.add_argument("--request-rates", type=parse_rates, default=DEFAULT_RATES,
                       help="requests/s of the Poisson arrivals, one row each; inf sends all at once "
                            "(default: 1,4,16)")
    serve.add_argument("--num-prompts", type=int, default=ServeSetup.num_prompts,
                       help="requests per rate (default: %(default)s)")
    serve.add_argument("--request-timeout", type=float, default=ServeSetup.request_timeout_s,
                       help="seconds after which a request counts as failed (default: %(default)s)")
    how = parser.add_argument_group("how")
    how.add_argument("--out", type=Path, help="JSON result file (default: bench-results/<suite>-<time>.json)")
    how.add_argument("--max-seconds", type=float, help="time budget: later measurements are skipped (default: none)")
    how.add_argument("--output-len", type=int,
                     help="every request generates exactly N tokens (quick runs; default: the workload's lengths)")
    how.add_argument("--warmup-tokens", type=int, default=None,
                     help="cap on tokens per warm-up request (default: the full length; 0: no warm-up)")
    how.add_argument("--repeats", type=int, default=3,
                     help="timed runs per engine measurement, the median is reported (default: 3)")
    how.add_argument("--cost-repeats", type=int, default=30, help="timed steps per step-cost median (default: 30)")
    how.add_argument("--paired-instances", type=int, default=1,
                     help="engines of each kind in a paired measurement (adaptive rows): identical engines "
                          "in one process differ by a few percent (default: 1)")
    how.add_argument("--no-hf", action="store_true", help="suites: skip the transformers peers")
    how.add_argument("--only", nargs="+", metavar="PATTERN",
                     help="suites: run only the rows whose names match these shell patterns "
                          "(e.g. 'sweep/3b-eagle3/*'), and the rows they are compared with")
    how.add_argument("--gpt-fast", metavar="PATH",
                     help="a gpt-fast checkout: decode-speed also times its compiled decode (rows w1/*/gpt-fast)")
    add_engine_args(parser)
    # None = sized by the workload (engine_runner.engine_config)
    parser.set_defaults(max_batch_size=None, max_seq_len=None)


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    values = engine_values(args)
    return {k: v for k, v in values.items() if not (k in ("max_batch_size", "max_seq_len") and v is None)}


def check_serve_extra(url: str | None) -> None:
    """--suite serve needs the server extra (httpx sends the load; FastAPI and uvicorn run our
    server unless --url names another): ValueError naming what to install, before anything runs."""
    missing = [m.name for m in ((HTTPX,) if url else (HTTPX, FASTAPI, UVICORN)) if not m.installed()]
    if missing:
        raise ValueError(f"--suite serve needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         f"not installed: pip install '{HTTPX.install}' (in a checkout: pip install -e '.[server]')")


SERVE_FLAGS = {"url": None, "request_rates": DEFAULT_RATES, "num_prompts": ServeSetup.num_prompts,
               "request_timeout": ServeSetup.request_timeout_s}


def _serve_setup(args: argparse.Namespace) -> ServeSetup | None:
    """The serve suite's setup from its flags (None for other suites, where they are an error)."""
    if args.suite != "serve":
        given = ["--" + k.replace("_", "-") for k, default in SERVE_FLAGS.items() if getattr(args, k) != default]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to --suite serve")
        return None
    return ServeSetup(rates=args.request_rates, num_prompts=args.num_prompts, url=args.url,
                      request_timeout_s=args.request_timeout, engine=_engine_overrides(args))


def _default_out(name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("bench-results") / f"{name}-{stamp}.json"


def run_bench(args: argparse.Namespace) -> int:
    if args.report:
        print("\n\n".join(markdown(load_run(p)) for p in args.report))
        return 0
    if args.plot:
        from infer_bench.plot import plot_files

        written = plot_files(args.plot, args.plot_dir)
        print("\n".join(str(p) for p in written) or "no finished engine measurements to plot")
        return 0 if written else 1
    if bool(args.suite) == bool(args.workload):
        raise ValueError("give exactly one of --suite NAME or --workload NAME (or --report FILES)")
    name = args.suite or f"workload-{args.workload}"
    serve = _serve_setup(args)
    if args.workload:
        engine_config_from_args(args)  # what the engine flags get wrong, before any row runs
    options = HarnessOptions(device=args.device, output_len=args.output_len, warmup_tokens=args.warmup_tokens,
                             max_seconds=args.max_seconds, cost_repeats=args.cost_repeats, repeats=args.repeats,
                             paired_instances=args.paired_instances, with_hf=not args.no_hf,
                             model=args.model, draft_model=args.draft_model, threads=args.threads,
                             gpt_fast=args.gpt_fast)
    if args.suite:
        table, selected = suite_rows(args.suite, options, serve)
        if args.only:  # (the rows they compare with still run: `run_rows` adds the refs)
            selected = [n for n in selected if any(fnmatch.fnmatchcase(n, p) for p in args.only)]
            if not selected:
                raise ValueError(f"--only {' '.join(args.only)} matches no row of suite {args.suite!r}: "
                                 f"see `infer bench --suite {args.suite} --list`")
    else:
        workload = get_workload(args.workload).with_temperature(args.temperature)
        table, selected = custom_rows(workload, _engine_overrides(args), args.hf)
    if args.list:
        print("\n".join(f"{n}  ({table[n].kind}): {table[n].what}" for n in with_refs(selected, table)))
        return 0
    if serve is not None:
        check_serve_extra(serve.url)
    out = args.out or _default_out(name)
    recorded = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    run = BenchRun(suite=name, environment=environment_info(resolve_device(args.device)), options=recorded)
    Harness(run, options, out).run_rows(selected, table)
    save_run(run, out)
    print()
    print(console_table(run))
    print(f"\nresults: {out}")
    return exit_status(run)


def exit_status(run: BenchRun) -> int:
    """1 when a measurement failed or none succeeded; skipped ones (with their reason) are no failure."""
    failed = [m.name for m in run.measurements if m.status == "error"]
    if failed:
        print(f"{len(failed)} measurement(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or not any(m.ok for m in run.measurements) else 0
