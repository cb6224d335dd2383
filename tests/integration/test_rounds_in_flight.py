"""Rounds in flight (CPU, tiny checkpoints): under overlapped scheduling an EAGLE head's greedy
round is queued before the host reads the verdict of the round before it, its rows moved on
the device by the drafts not accepted. Lossless at every acceptance (the benchmark's oracle
replaces the drafts on the device), beside stop ids, stop strings, short max_tokens, a
tight pool's preemptions and an abort, with every resource given back; the synchronous
engine never follows a round."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from helpers.eagle_heads import write_head

from infer import SamplingParams
from infer_bench.oracle import OracleProposer
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine

OUTPUT = 40
K = 3


@pytest.fixture(scope="module")
def head(ckpt_a: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head") / "eagle3", ckpt_a, "eagle3", draft_vocab=120,
                      aux_layers=[0, 1, 1])


@pytest.fixture(scope="module")
def prompts(ckpt_a: Path) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(300) for _ in range(rng.randint(6, 18))] for _ in range(4)]


def _engine(ckpt: Path, head: Path, overlap: bool, **options) -> Engine:
    return Engine(EngineConfig(model=str(ckpt), draft_model=str(head), use_speculative_decoding=True,
                               speculative_method="eagle3", spec_length=K, spec_batch_gate=False, device="cpu",
                               max_batch_size=4, max_seq_len=128, async_scheduling=overlap, **options))


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int = OUTPUT) -> list[list[int]]:
    """Every prompt at once, greedy: prompt + output each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [p + r.output_token_ids for p, r in zip(prompts, requests, strict=True)]


@pytest.fixture(scope="module")
def records(ckpt_a: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The target's greedy continuations (plain decoding)."""
    engine = Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=4, max_seq_len=128))
    return _run(engine, prompts)


def _with_oracle(engine: Engine, records: list[list[int]], alpha: float) -> OracleProposer:
    speculation = engine.runner.speculation
    assert speculation is not None
    oracle = OracleProposer(speculation.proposer, records, engine.vocab_size, alpha, seed=5)
    speculation.proposer = oracle
    return oracle


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_rounds_in_flight_are_lossless_at_every_acceptance(ckpt_a, head, prompts, records, alpha) -> None:
    engine = _engine(ckpt_a, head, overlap=True)
    oracle = _with_oracle(engine, records, alpha)
    assert _run(engine, prompts) == records
    runner, counts = engine.runner, oracle.counts
    stats = runner.stats
    # (stats.followed counts steps, stats.rounds each request's rounds; the first round and
    # the tail, where a request's length cuts K, do not follow)
    assert runner.stats.followed > stats.rounds / len(prompts) / 2
    assert counts.accepted == stats.accepted_tokens and counts.off_record_rounds == 0
    if alpha in (0.0, 1.0):
        assert counts.acceptance == alpha
    else:
        assert abs(counts.acceptance - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / counts.tried)
    assert engine.leak_report() == [] and not runner.has_pending()


def test_the_synchronous_engine_follows_no_round(ckpt_a, head, prompts, records) -> None:
    engine = _engine(ckpt_a, head, overlap=False)
    _with_oracle(engine, records, 0.8)
    assert _run(engine, prompts) == records
    assert engine.runner.stats.followed == 0 and engine.runner.stats.rounds > 0


def test_rounds_in_flight_under_preemption_keep_every_token(ckpt_a, head, prompts, records) -> None:
    # (a pool of 24 blocks of 4 holds about two of the four requests: the newest are preempted
    # while their rounds are in flight, and recomputed)
    engine = _engine(ckpt_a, head, overlap=True, kv_cache_backend="paged", block_size=4, num_blocks=24)
    oracle = _with_oracle(engine, records, 0.8)
    assert _run(engine, prompts) == records
    assert engine.scheduler.num_preemptions > 0 and engine.runner.stats.followed > 0
    assert oracle.counts.off_record_rounds == 0
    assert engine.leak_report() == [] and not engine.runner.has_pending()


def test_a_short_max_tokens_ends_where_plain_decoding_ends(ckpt_a, head, prompts, records) -> None:
    engine = _engine(ckpt_a, head, overlap=True)
    _with_oracle(engine, records, 1.0)  # (whole rounds: a round in flight carries the request past its end)
    got = _run(engine, prompts, max_tokens=11)
    assert got == [rec[:len(p) + 11] for p, rec in zip(prompts, records, strict=True)]
    assert engine.runner.stats.followed > 0 and engine.leak_report() == []


def _finishes(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [(r.output_token_ids, r.output_text, r.finish_reason) for r in requests]


def test_stop_ids_and_strings_end_a_request_inside_a_round_in_flight(ckpt_a, head, prompts, records) -> None:
    outputs = [rec[len(p):] for p, rec in zip(prompts, records, strict=True)]
    params = [SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, stop_token_ids=[outputs[0][9]]),
              SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, stop_token_ids=[outputs[1][22]]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)]
    got = {}
    for overlap in (False, True):
        engine = _engine(ckpt_a, head, overlap=overlap)
        _with_oracle(engine, records, 0.8)
        got[overlap] = _finishes(engine, prompts, params)
        assert engine.leak_report() == [] and not engine.runner.has_pending()
        assert (engine.runner.stats.followed > 0) == overlap
    assert got[True] == got[False]
    assert got[True][0][0] == outputs[0][:outputs[0].index(outputs[0][9]) + 1]
    assert got[True][2][0] == outputs[2][:7] and got[True][3][0] == outputs[3]
    text = got[False][3][1]  # (a stop string from the fourth request's text, mid-run)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params[3] = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True, stop=[stop])
    for overlap in (False, True):
        engine = _engine(ckpt_a, head, overlap=overlap)
        _with_oracle(engine, records, 0.8)
        got[overlap] = _finishes(engine, prompts, params)
        assert engine.leak_report() == []
    assert got[True] == got[False] and got[True][3][2] is not None and got[True][3][2].value == "stop"


def test_an_abort_with_a_round_in_flight_gives_everything_back(ckpt_a, head, prompts, records) -> None:
    engine = _engine(ckpt_a, head, overlap=True)
    _with_oracle(engine, records, 0.8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts[:2]]
    while engine.runner.stats.followed == 0:  # (a round in flight and its successor queued)
        engine.step()
    final = engine.abort(requests[0].request_id)
    assert final is not None and final.finish_reason is not None and final.finish_reason.value == "abort"
    want = [rec[len(p):] for p, rec in zip(prompts, records, strict=True)]
    assert requests[0].output_token_ids == want[0][:len(requests[0].output_token_ids)]
    while engine.has_unfinished():
        engine.step()
    assert requests[1].output_token_ids == want[1][:30]
    assert engine.leak_report() == [] and not engine.runner.has_pending()
