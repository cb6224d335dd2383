"""Checks of a draft model's rounds drafted ahead, shared by the CPU and GPU tests."""

from __future__ import annotations

from infer import SamplingParams
from infer_bench.oracle import OracleProposer
from infer.engine.engine import Engine
from infer.speculative.draft_model import DraftModelProposer

OUTPUT = 40


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams] | None = None,
            max_tokens: int = OUTPUT) -> list[list[int]]:
    """Every prompt at once (greedy by default): prompt + output each."""
    params = params or [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * len(prompts)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [p + r.output_token_ids for p, r in zip(prompts, requests, strict=True)]


def check_drafts_ahead_continue(engine: Engine, draft: DraftModelProposer, prompts: list[list[int]],
                                records: list[list[int]], max_tokens: int = OUTPUT, near_ties: float = 0.0) -> None:
    """`engine` drafts with the target itself (`draft`); the oracle rejects drafts at random,
    so the rounds ahead start from every accepted count: the draft's own drafts, taken
    ahead or not, are the target's continuation (records: prompt + greedy output) only if
    each row's feed moved by a - k on the device. `near_ties`: the share of rounds allowed
    to differ (bf16: a draft step and a plain step may round a near-tie apart)."""
    speculation = engine.runner.speculation
    assert speculation is not None
    seen: list[tuple[int, int, list[int]]] = []  # (n, the prompt's first token, drafts)
    propose = draft.propose

    def recording(requests, shape, depths):
        drafts = propose(requests, shape, depths)
        for r, d in zip(requests, drafts, strict=True):
            if d.num_proposed:
                seen.append((r.num_computed_tokens, r.token_slice(0, 1)[0], list(d.token_ids[:d.num_proposed])))
        return drafts

    draft.propose = recording  # type: ignore[method-assign]
    oracle = OracleProposer(draft, records, engine.vocab_size, 0.5, seed=7)
    speculation.proposer = oracle
    assert run_all(engine, prompts, max_tokens=max_tokens) == records
    assert draft.ahead_rounds > 0 and 0 < oracle.counts.accepted < oracle.counts.tried
    by_first = {rec[0]: rec for rec in records}
    assert len(by_first) == len(records)
    # (g is token n: the drafts are tokens n + 1 ..)
    wrong = [(n, tokens) for n, first, tokens in seen if tokens != by_first[first][n + 1:n + 1 + len(tokens)]]
    assert len(wrong) <= near_ties * len(seen), f"{len(wrong)} of {len(seen)} rounds drafted off the continuation"
    assert engine.leak_report() == [] and draft.marks == {}
