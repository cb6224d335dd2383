"""A fault of one request fails that request alone (CPU, tiny checkpoints).

One request of a batch is broken on purpose, in each place a request's own work runs:
its sampling (a temperature that passed validation but makes its distribution NaN), its
grammar (a grammar state that raises when it advances, or when it fills its mask), its
draft (an n-gram table that raises; a model draft sampled from NaN). Under plain decoding,
chains and trees, the broken request finishes with an error naming it, every other request
of the batch finishes with the tokens it gets when the broken one is healthy, the engine
goes on serving, and nothing leaks. Also: an allow-nothing grammar and a huge temperature
with a grammar (which used to kill the engine) fail their request alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from infer import SamplingParams
from infer.engine.request import FinishReason, Request
from infer.sampling import StructuredOutput

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
VICTIM = 1  # the broken request's place in the batch

STEPS = {
    "plain": {},
    "chain": dict(use_speculative_decoding=True, spec_length=3),
    "tree": dict(use_speculative_decoding=True, spec_tree="2,1,1"),
    "dynamic": dict(use_speculative_decoding=True, spec_tree="dynamic:6:2", spec_length=3),
    "ngram": dict(use_speculative_decoding=True, speculative_method="ngram", spec_length=3),
    "ngram-tree": dict(use_speculative_decoding=True, speculative_method="ngram", spec_tree="2,1,1"),
    # (no cache of finished outputs: the seeded row's drafts, so its tokens, then repeat across runs)
    "suffix": dict(speculative_method="suffix", spec_tree="dynamic:6:2", spec_length=3, spec_suffix_cache_tokens=0),
}


class FlakyGrammar:
    """A grammar that allows every token and raises in `where` ("accept" or "fill") once it
    has accepted `after` tokens."""

    def __init__(self, vocab_size: int, where: str, after: int = 2) -> None:
        self.vocab_size, self.where, self.after, self.accepted = vocab_size, where, after, 0

    def _check(self, where: str) -> None:
        if where == self.where and self.accepted >= self.after:
            raise RuntimeError(f"injected {where} failure")

    def accept(self, token_id: int) -> None:
        self._check("accept")
        self.accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._check("fill")
        bitmask[row] = -1

    def fill_after(self, bitmask: torch.Tensor, row: int, path: Sequence[int]) -> None:
        self._check("fill")
        bitmask[row] = -1


def with_grammar(request: Request, grammar: FlakyGrammar) -> None:
    """Give the request a grammar state of the test's (its params say it has one, as the
    engine's own grammars do)."""
    request.sampling_params = replace(request.sampling_params, structured=StructuredOutput(json_object=True),
                                      ignore_eos=False)
    request.grammar = grammar


def nan_temperature(params: SamplingParams) -> SamplingParams:
    """A copy whose temperature is NaN (as a value that passed validation but breaks the math)."""
    broken = replace(params)
    object.__setattr__(broken, "temperature", float("nan"))
    return broken


def run_batch(llm, prompts, params, breaks=None) -> tuple[list[Request], int]:
    """Add every prompt, break the victim (`breaks(request)`), step to the end -> (requests, steps)."""
    engine = llm.engine
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    if breaks is not None:
        breaks(requests[VICTIM])
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    return requests, steps


def others(requests: list[Request]) -> list[list[int]]:
    return [list(r.output_token_ids) for i, r in enumerate(requests) if i != VICTIM]


def check_isolated(make_llm, ckpt, step: str, breaks, victim_params=GREEDY, draft=None):
    kw = dict(STEPS[step])
    if step in ("chain", "tree", "dynamic"):
        kw["draft_model"] = str(draft or ckpt)
    llm = make_llm(ckpt, max_seq_len=128, max_batch_size=4, **kw)
    prompts = [[0, 5, 6, 7], [0, 8, 9, 8, 9], [0, 10, 11], [0, 12, 13, 12]]
    params = [GREEDY, victim_params, SEEDED, GREEDY]
    healthy, _ = run_batch(llm, prompts, params)
    broken, _ = run_batch(llm, prompts, params, breaks)
    victim = broken[VICTIM]
    assert victim.finish_reason is FinishReason.ERROR
    assert victim.fault is not None and victim.request_id in victim.fault
    assert others(broken) == others(healthy)
    assert all(r.finish_reason is FinishReason.LENGTH for i, r in enumerate(broken) if i != VICTIM)
    again, _ = run_batch(llm, prompts, params)  # the engine goes on serving
    assert [list(r.output_token_ids) for r in again] == [list(r.output_token_ids) for r in healthy]
    assert llm.engine.leak_report() == []
    return victim


@pytest.mark.parametrize("step", list(STEPS))
def test_a_request_whose_sampling_breaks_fails_alone(make_llm, ckpt_a, step):
    def breaks(request: Request) -> None:
        request.sampling_params = nan_temperature(request.sampling_params)
    victim = check_isolated(make_llm, ckpt_a, step, breaks, victim_params=SEEDED)
    assert "not finite" in victim.fault or "drafting" in victim.fault


@pytest.mark.parametrize("where", ["accept", "fill"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_request_whose_grammar_breaks_fails_alone(make_llm, ckpt_a, step, where):
    def breaks(request: Request) -> None:
        with_grammar(request, FlakyGrammar(400, where))
    victim = check_isolated(make_llm, ckpt_a, step, breaks)
    assert f"injected {where} failure" in victim.fault
    assert len(victim.output_token_ids) < GREEDY.max_tokens  # it stopped where its grammar broke


@pytest.mark.parametrize("step", ["ngram", "ngram-tree", "suffix"])
def test_a_request_whose_ngram_table_breaks_fails_alone(make_llm, ckpt_a, step, monkeypatch):
    llm_probe = make_llm(ckpt_a, max_seq_len=128, **STEPS[step])
    proposer = type(llm_probe.engine.runner.speculation.proposer)
    real = proposer.sync

    def sync(self, request):
        if request.request_id == self.victim_id:
            raise RuntimeError("injected table failure")
        return real(self, request)

    monkeypatch.setattr(proposer, "sync", sync)
    monkeypatch.setattr(proposer, "victim_id", None, raising=False)

    def breaks(request: Request) -> None:
        type(llm_probe.engine.runner.speculation.proposer).victim_id = request.request_id
    victim = check_isolated(make_llm, ckpt_a, step, breaks)
    assert "injected table failure" in victim.fault


def test_a_request_whose_model_draft_breaks_fails_alone(make_llm, ckpt_a, random_draft, monkeypatch):
    # the draft model's logits for the victim's rows are NaN: its draft tokens are NO_TOKEN
    # (a tree's draft from NaN logits is garbage, not a fault: verification rejects it)
    from infer.speculative import draft_model as dm
    victim_rows: list[bool] = []
    real = dm.ChainSteps.draw

    def draw(self, logits, alive, uniforms):
        logits = logits.clone()
        for j, b in enumerate(alive):
            if self.reqs[b].request_id in victim_ids:
                logits[j] = float("nan")
                victim_rows.append(True)
        return real(self, logits, alive, uniforms)

    victim_ids: set[str] = set()
    monkeypatch.setattr(dm.ChainSteps, "draw", draw)

    def breaks(request: Request) -> None:
        victim_ids.add(request.request_id)
    # (a penalty makes the draft step through ChainSteps.draw, where the NaN is injected)
    victim = check_isolated(make_llm, ckpt_a, "chain", breaks,
                            victim_params=replace(GREEDY, repetition_penalty=1.1), draft=random_draft)
    assert victim_rows and victim.fault is not None


def test_a_huge_temperature_with_a_grammar_fails_its_request_alone(make_llm, ckpt_a):
    pytest.importorskip("xgrammar")
    llm = make_llm(ckpt_a, max_seq_len=128)
    choice = StructuredOutput(choice=("ab", "cd"))
    broken = SamplingParams(temperature=1.0, max_tokens=4, structured=choice)
    object.__setattr__(broken, "temperature", 1e39)  # what float32 cannot hold
    requests, _ = run_batch(llm, [[0, 5], [0, 6], [0, 7]], [GREEDY, broken, GREEDY])
    assert requests[VICTIM].finish_reason is FinishReason.ERROR
    assert [len(r.output_token_ids) for i, r in enumerate(requests) if i != VICTIM] == [12, 12]
    assert llm.engine.leak_report() == []


def test_a_grammar_that_allows_nothing_fails_its_request_alone(make_llm, ckpt_a):
    class Nothing(FlakyGrammar):
        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = 0  # no token allowed

    llm = make_llm(ckpt_a, max_seq_len=128)

    def breaks(request: Request) -> None:
        with_grammar(request, Nothing(400, "never"))
    requests, _ = run_batch(llm, [[0, 5], [0, 6], [0, 7]], [GREEDY, GREEDY, GREEDY], breaks)
    assert requests[VICTIM].finish_reason is FinishReason.ERROR
    assert "allowed no token" in requests[VICTIM].fault
    assert [len(r.output_token_ids) for i, r in enumerate(requests) if i != VICTIM] == [12, 12]
