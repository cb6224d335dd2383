"""A draft model's rounds drafted ahead (CPU, tiny checkpoints): a greedy chain round drafts
the next round under its verification, fed from the verdict on the device. A self-draft
accepts every draft only if the draft's cache holds exactly the request's tokens after every
round, whether the next round takes the drafts ahead or drops them (plain steps between
rounds, K changing); outputs match plain decoding and the engine that does not draft
ahead, with sampled rows beside greedy ones, the oracle's controlled acceptance and a
tight pool's preemptions, every resource given back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers.draft_ahead import OUTPUT, check_drafts_ahead_continue, run_all
from helpers.spec_e2e import CyclePolicy, random_draft

from infer import SamplingParams
from infer_bench.oracle import OracleProposer
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.speculative.draft_model import DraftModelProposer

K = 3


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(300) for _ in range(rng.randint(5, 30))] for _ in range(4)]


@pytest.fixture(scope="module")
def records(ckpt_a: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The target's greedy continuations (plain decoding), prompt + output each."""
    return run_all(Engine(EngineConfig(model=str(ckpt_a), device="cpu", max_batch_size=4, max_seq_len=128)), prompts)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_draft(tmp_path_factory.mktemp("draft"))


def _engine(ckpt: Path, draft: Path, ahead: bool, **options) -> tuple[Engine, DraftModelProposer]:
    options = {"max_batch_size": 4, "block_size": 4, **options}
    engine = Engine(EngineConfig(model=str(ckpt), draft_model=str(draft), use_speculative_decoding=True,
                                 spec_length=K + 1, spec_batch_gate=False, device="cpu", max_seq_len=128,
                                 **options))
    speculation = engine.runner.speculation
    assert speculation is not None and isinstance(speculation.proposer, DraftModelProposer)
    speculation.proposer.ahead = ahead
    return engine, speculation.proposer


@pytest.mark.parametrize("cycle", [[K], [K, 0], [K, K, 0, 2], [K + 1, 0, 2, K]])
def test_a_self_draft_drafted_ahead_accepts_everything(ckpt_a, prompts, records, cycle) -> None:
    # (the draft is the target: any position of its cache fed a wrong token, or fed at the
    # wrong place, shows as a rejected draft)
    engine, draft = _engine(ckpt_a, ckpt_a, ahead=True)
    speculation = engine.runner.speculation
    assert speculation is not None
    speculation.policy = CyclePolicy(cycle)
    assert run_all(engine, prompts) == records
    stats = engine.runner.stats
    assert stats.rounds > 0 and stats.accepted_tokens == stats.draft_tokens
    taken = [a for a, b in zip(cycle, cycle[1:] + cycle[:1]) if a and b and b <= a]
    assert (draft.ahead_rounds > 0) == bool(taken)  # (a round takes the drafts ahead only right after one)
    assert engine.leak_report() == [] and draft.marks == {}


def test_drafting_ahead_changes_no_token(ckpt_a, other_draft, prompts, records) -> None:
    # greedy rows draft ahead, seeded sampled rows do not: every token as without it
    params = [SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=OUTPUT, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=12, top_p=0.9, max_tokens=OUTPUT, ignore_eos=True)]
    got = {}
    for ahead in (False, True):
        engine, draft = _engine(ckpt_a, other_draft, ahead=ahead)
        got[ahead] = run_all(engine, prompts, params)
        assert (draft.ahead_rounds > 0) == ahead
        assert engine.leak_report() == []
    assert got[True] == got[False]
    assert got[True][0] == records[0] and got[True][2] == records[2]


def test_a_self_draft_ahead_of_a_partly_accepted_round_drafts_the_continuation(ckpt_a, prompts, records) -> None:
    engine, draft = _engine(ckpt_a, ckpt_a, ahead=True)
    check_drafts_ahead_continue(engine, draft, prompts, records)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_drafted_ahead_under_the_oracle_and_a_tight_pool(ckpt_a, other_draft, prompts, records, alpha) -> None:
    # (the oracle replaces every draft, at the acceptance it is given; a pool of 40 blocks of 4
    # holds about two of the four requests: the newest are preempted, their drafts ahead dropped)
    engine, draft = _engine(ckpt_a, other_draft, ahead=True, kv_cache_backend="paged", num_blocks=40)
    speculation = engine.runner.speculation
    assert speculation is not None
    oracle = OracleProposer(speculation.proposer, records, engine.vocab_size, alpha, seed=5)
    speculation.proposer = oracle
    assert run_all(engine, prompts) == records
    assert engine.scheduler.num_preemptions > 0 and draft.ahead_rounds > 0
    assert oracle.counts.accepted == engine.runner.stats.accepted_tokens and oracle.counts.off_record_rounds == 0
    assert engine.leak_report() == [] and draft.marks == {}


def test_unseeded_sampled_rows_draft_ahead_with_their_q(ckpt_a, other_draft, prompts) -> None:
    # (their losslessness: tests/integration/test_speculative_sampling.py; here the rounds ahead
    # keep q beside their tokens, on a tight pool with preemptions and K changing, and give
    # every resource back)
    engine, draft = _engine(ckpt_a, other_draft, ahead=True, kv_cache_backend="paged", num_blocks=40)
    speculation = engine.runner.speculation
    assert speculation is not None
    speculation.policy = CyclePolicy([K, K, 2, 0, K])
    marks: list[bool] = []
    verifying = draft.verifying

    def recording(requests, drafts, starts, verdict):
        verifying(requests, drafts, starts, verdict)
        marks.extend(m.probs is not None for r in requests if (m := draft.marks.get(r.request_id)) is not None)

    draft.verifying = recording  # type: ignore[method-assign]
    params = [SamplingParams(temperature=0.8, max_tokens=OUTPUT, ignore_eos=True) for _ in prompts]
    outputs = run_all(engine, prompts, params)
    assert [len(o) - len(p) for o, p in zip(outputs, prompts, strict=True)] == [OUTPUT] * len(prompts)
    assert marks and all(marks) and draft.ahead_rounds > 0 and engine.scheduler.num_preemptions > 0
    assert engine.leak_report() == [] and draft.marks == {}
