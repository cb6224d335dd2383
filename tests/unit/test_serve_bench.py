"""The serving benchmark's pure parts (CPU, no server, no timing asserted): the seeded
ShareGPT-like mix, the Poisson schedule (statistical tests on the generated times), the
setup's validation, our server's flags, the derived ratios, the table and the CLI flags."""

from __future__ import annotations

import argparse
import math

import pytest

from infer_bench import suites
from infer_bench.cli import run_bench
from infer_bench.rows import HarnessOptions
from infer_bench.serve import (SERVE_KIND, ServeSetup, parse_rates, rate_tag, serve_derived, server_flags)
from infer_bench.serve_mix import SHAREGPT_LIKE, TOKEN_RANGE, LengthMix, draw_requests, poisson_schedule
from infer.cli import build_parser


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


def test_the_mix_is_reproducible_and_seeded() -> None:
    a, b = draw_requests(SHAREGPT_LIKE, 200, seed=7), draw_requests(SHAREGPT_LIKE, 200, seed=7)
    assert a == b
    assert draw_requests(SHAREGPT_LIKE, 200, seed=8) != a
    assert [r.index for r in a] == list(range(200))


def test_the_mix_resembles_sharegpt_and_keeps_its_bounds() -> None:
    reqs = draw_requests(SHAREGPT_LIKE, 4000, seed=0)
    prompts = sorted(len(r.prompt_ids) for r in reqs)
    outputs = sorted(r.output_len for r in reqs)
    assert 80 <= prompts[len(prompts) // 2] <= 120 and 200 <= outputs[len(outputs) // 2] <= 300  # medians
    assert sum(prompts) / len(prompts) > prompts[len(prompts) // 2]  # long right tail
    m = SHAREGPT_LIKE
    assert all(m.min_len <= len(r.prompt_ids) <= m.max_prompt for r in reqs)
    assert all(m.min_len <= r.output_len and len(r.prompt_ids) + r.output_len <= m.max_total for r in reqs)
    assert all(TOKEN_RANGE[0] <= t < TOKEN_RANGE[1] for r in reqs[:50] for t in r.prompt_ids)


def test_the_mix_fits_a_short_context_and_a_fixed_output_length() -> None:
    mix = SHAREGPT_LIKE.within(256)
    assert mix.max_total == 256 and mix.max_prompt == 128
    reqs = draw_requests(mix, 500, seed=1, output_len=16)
    assert all(len(r.prompt_ids) + r.output_len <= 256 for r in reqs)
    assert all(r.output_len == 16 for r in reqs)
    assert SHAREGPT_LIKE.within(None) is SHAREGPT_LIKE and SHAREGPT_LIKE.within(4096) is SHAREGPT_LIKE
    with pytest.raises(ValueError, match="shorter than the shortest"):
        SHAREGPT_LIKE.within(6)
    with pytest.raises(ValueError, match="max_prompt"):
        LengthMix(max_prompt=2000, max_total=2000)
    with pytest.raises(ValueError, match=">= 1"):
        draw_requests(SHAREGPT_LIKE, 0, seed=0)


def _ks_exponential(gaps: list[float], rate: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps and Exp(rate)."""
    xs, n = sorted(gaps), len(gaps)
    cdf = [1 - math.exp(-rate * x) for x in xs]
    return max(max((i + 1) / n - c, c - i / n) for i, c in enumerate(cdf))


@pytest.mark.parametrize("rate", [0.5, 4.0, 64.0])
def test_arrivals_are_poisson_at_the_requested_rate(rate: float) -> None:
    n = 5000
    times = poisson_schedule(rate, n, seed=3)
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    # mean gap 1/rate within 4 standard errors (the sd of an exponential gap is its mean)
    assert abs(sum(gaps) / n - 1 / rate) < 4 / rate / math.sqrt(n)
    # exponential gaps: KS distance below the 1% critical value 1.63 / sqrt(n)
    assert _ks_exponential(gaps, rate) < 1.63 / math.sqrt(n)
    # counts in unit windows (of mean 10 arrivals) have variance near their mean (Poisson dispersion 1)
    width = 10 / rate
    counts = [0] * int(times[-1] / width)
    for t in times:
        if int(t / width) < len(counts):
            counts[int(t / width)] += 1
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    assert 0.75 < var / mean < 1.3


def test_a_schedule_is_seeded_and_inf_sends_at_once() -> None:
    assert poisson_schedule(2.0, 50, seed=1) == poisson_schedule(2.0, 50, seed=1) != poisson_schedule(2.0, 50, 2)
    assert poisson_schedule(math.inf, 5, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="> 0"):
        poisson_schedule(0.0, 5, seed=0)


def test_rates_parse_and_bad_ones_say_what_to_fix() -> None:
    assert parse_rates("1,4,16") == (1.0, 4.0, 16.0)
    assert parse_rates("0.5, inf") == (0.5, math.inf)
    assert [rate_tag(r) for r in parse_rates("0.5,2,inf")] == ["r0.5", "r2", "rinf"]
    for bad in ("", "1,1", "0,2", "-1", "fast"):
        with pytest.raises(ValueError, match="--request-rates"):
            parse_rates(bad)


def test_setup_validation() -> None:
    assert ServeSetup().label == "ours" and ServeSetup(url="http://127.0.0.1:8000").label == "peer"
    with pytest.raises(ValueError, match="--url"):
        ServeSetup(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="num_prompts"):
        ServeSetup(num_prompts=0)
    with pytest.raises(ValueError, match="distinct"):
        ServeSetup(rates=(2.0, 2.0))


def test_server_flags_are_the_non_default_engine_fields() -> None:
    flags = server_flags({"model": "m", "device": "cpu", "max_batch_size": None, "use_cuda_graphs": True,
                          "enable_prefix_caching": False, "async_scheduling": None, "max_seq_len": 2048})
    assert flags == ["--model", "m", "--device", "cpu", "--use-cuda-graphs", "--no-enable-prefix-caching",
                     "--max-seq-len", "2048"]
    parsed = _parse(["serve", *flags])  # the server's parser reads them back
    assert parsed.use_cuda_graphs and parsed.enable_prefix_caching is False and parsed.max_seq_len == 2048
    with pytest.raises(ValueError, match="no EngineConfig field"):
        server_flags({"nope": 1})


def test_derived_ratios() -> None:
    d = serve_derived({"requests": 10, "completed": 9, "request_throughput": 3.0}, {"request_rate": 4.0})
    assert d == {"completed_fraction": 0.9, "of_offered_rate": 0.75}
    assert "of_offered_rate" not in serve_derived({"requests": 2, "completed": 2, "request_throughput": 5.0},
                                                  {"request_rate": "inf"})


def test_the_serve_suite_has_a_row_a_rate() -> None:
    setup = ServeSetup(rates=(1.0, 8.0, math.inf))
    table, selected = suites.suite_rows("serve", HarnessOptions(device="cpu"), setup)
    assert selected == ["serve/ours/r1", "serve/ours/r8", "serve/ours/rinf"]
    assert {table[n].kind for n in selected} == {SERVE_KIND}
    _, peer = suites.suite_rows("serve", HarnessOptions(device="cpu"),
                                ServeSetup(rates=(2.0,), url="http://127.0.0.1:9"))
    assert peer == ["serve/peer/r2"]
    assert not suites.SUITES["serve"].in_all_gpu


def test_serve_flags_on_another_suite_are_an_error() -> None:
    args = _parse(["bench", "--suite", "smoke", "--url", "http://127.0.0.1:9", "--list"])
    with pytest.raises(ValueError, match="--url only apply to --suite serve"):
        run_bench(args)
    listed = _parse(["bench", "--suite", "serve", "--request-rates", "2,inf", "--list"])
    assert listed.request_rates == (2.0, math.inf)
    assert run_bench(listed) == 0
