"""Benchmarks of the `infer` engine: workloads, roofline probe, engine and peer runs, reports.

A package of its own beside `infer` (which never imports it): `infer bench` is its command,
registered under the `infer.commands` entry points; `python -m infer_bench` runs it from a checkout.
"""

from __future__ import annotations

import argparse


def _bench_args(p: argparse.ArgumentParser) -> None:
    from infer_bench.cli import add_bench_args, run_bench

    add_bench_args(p)
    p.set_defaults(func=run_bench)


COMMAND = ("run benchmark workloads, write JSON results; --plot draws them", _bench_args)  # infer.cli's Command
