"""A draft with another tokenizer, end to end (CPU, tiny checkpoints; helpers/foreign_vocab.py).

Greedy parity with plain decoding of the target for chains, a static and a dynamic tree,
over the engine configurations of the other speculation tests (prefix caching, small
chunks, forced preemption), with a draft whose vocabulary was trained on another corpus;
the target's own weights under a shuffled vocabulary accept (nearly) every draft, so the
mapping is right both ways; a draft whose cache runs past max_seq_len (target tokens it
reads as several) stops drafting there; the adaptive policy's plain steps between rounds and
a sharded draft under tensor parallelism keep parity; nothing leaks (make_llm checks every
engine).
"""

from __future__ import annotations

import logging
import re

import pytest

from helpers.foreign_vocab import foreign_draft, permuted_draft
from helpers.spec_e2e import DEPTH as K, ENGINE_CONFIGS, GREEDY, run, spec_llm, word_prompts
from infer import LLM, SamplingParams
from infer.server.metrics import spec_metrics
from infer.speculative.foreign_draft import ForeignDraftProposer
from infer.speculative.metrics import SpecStats

SHAPES = {"chain": None, "tree": "3,2,1,1", "dynamic": "dynamic:6:2"}


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    return foreign_draft(tmp_path_factory.mktemp("foreign"))


@pytest.fixture(scope="module")
def permuted(ckpt_a, tmp_path_factory):
    return permuted_draft(ckpt_a, tmp_path_factory.mktemp("permuted") / "draft")


def _proposer(llm) -> ForeignDraftProposer:
    proposer = llm.engine.runner.speculation.proposer
    assert isinstance(proposer, ForeignDraftProposer)
    return proposer


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_parity_chain(make_llm, ckpt_a, foreign, prompts, plain_outputs, config, caplog):
    caplog.set_level(logging.INFO, logger="infer.engine")
    llm = spec_llm(make_llm, ckpt_a, foreign, 8, **ENGINE_CONFIGS[config])
    # the shared fraction: logged at the pairing and in the start-up line
    assert re.search(r"another vocabulary than the target .*: drafting over the tokens they share \(\d+ shared",
                     caplog.text)
    assert re.search(r"engine ready in .*; the draft drafts over \d+ shared tokens, \d+\.\d% of the smaller",
                     caplog.text)
    assert [o.outputs[0].token_ids for o in run(llm, prompts, 8)] == plain_outputs
    proposer = _proposer(llm)
    assert 0.25 <= llm.engine.runner.stats.shared_vocabulary < 1.0
    # and in /metrics (a gauge only where the draft has another vocabulary)
    gauges = {f.name: f.samples[0].value for f in spec_metrics(llm.engine.runner.stats) if f.type == "gauge"}
    assert gauges == {"infer_spec_shared_vocabulary": llm.engine.runner.stats.shared_vocabulary}
    assert not [f for f in spec_metrics(SpecStats()) if f.type == "gauge"]
    # the prompts reach the draft through re-tokenized tokens too
    assert any(len(proposer.vocab.expand(t)) > 1 for p in prompts for t in p)
    assert llm.engine.runner.stats.draft_tokens > 0


@pytest.mark.parametrize("shape", ["tree", "dynamic"])
def test_greedy_parity_trees(make_llm, ckpt_a, foreign, prompts, plain_outputs, shape):
    llm = spec_llm(make_llm, ckpt_a, foreign, 8, spec_tree=SHAPES[shape], **ENGINE_CONFIGS["paged-prefix-small-chunks"])
    assert [o.outputs[0].token_ids for o in run(llm, prompts, 8)] == plain_outputs
    assert llm.engine.runner.stats.draft_tokens > 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_target_under_shuffled_ids_drafts_as_the_target_itself(make_llm, ckpt_a, permuted, prompts, plain_outputs,
                                                                    shape):
    # the same drafts in other ids: every count as with the target drafting for itself (a
    # wrong mapping would accept almost nothing)
    counts = []
    for draft in (permuted, ckpt_a):
        llm = spec_llm(make_llm, ckpt_a, draft, 1, spec_tree=SHAPES[shape])
        assert [o.outputs[0].token_ids for o in run(llm, prompts[:3], 1)] == plain_outputs[:3]
        s = llm.engine.runner.stats
        counts.append((s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_position))
    assert llm.engine.runner.stats.shared_vocabulary is None
    assert counts[0] == counts[1] and counts[0][2] >= counts[0][0]  # (at least one token a round)
    if shape == "chain":
        assert counts[0][2] == K * counts[0][0]


def test_sampled_self_draft_under_shuffled_ids_accepts_its_drafts(make_llm, ckpt_a, permuted, prompts):
    # q mapped to the target's columns is the target's p: min(1, p/q) = 1 (up to rounding)
    llm = spec_llm(make_llm, ckpt_a, permuted, 8)
    run(llm, prompts, 8, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                                        seed=1))
    assert llm.engine.runner.stats.acceptance_rate >= 0.97


def test_a_draft_reading_more_tokens_than_the_target_stops_at_max_seq_len(make_llm, ckpt_a, foreign, prompts):
    max_seq_len = 80
    plain = make_llm(ckpt_a, kv_cache_backend="contiguous", max_seq_len=max_seq_len)
    spec = make_llm(ckpt_a, kv_cache_backend="contiguous", max_seq_len=max_seq_len, max_batch_size=8,
                    use_speculative_decoding=True, draft_model=str(foreign), spec_length=K)
    vocab = _proposer(spec).vocab
    params = [SamplingParams(temperature=0, max_tokens=max_seq_len - len(p), ignore_eos=True) for p in prompts]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # the draft reads some request as more tokens than the target holds by the end
    assert any(sum(len(vocab.expand(t)) for t in p + o.outputs[0].token_ids) > max_seq_len
               for p, o in zip(prompts, outs, strict=True))


def test_greedy_parity_under_the_adaptive_policy(make_llm, ckpt_a, foreign, prompts, plain_outputs):
    # (plain steps between rounds: the draft catches up on their tokens, expanded)
    llm = spec_llm(make_llm, ckpt_a, foreign, 8, spec_policy="adaptive", spec_cost_coefficient=0.05)
    assert [o.outputs[0].token_ids for o in run(llm, prompts, 8)] == plain_outputs
    assert llm.engine.runner.stats.drafts > 0


def test_a_sharded_draft_of_shuffled_ids_under_tensor_parallelism(tp_ckpt, tmp_path):
    # the draft's logits are gathered whole on the driver, then masked and mapped there
    draft = permuted_draft(tp_ckpt, tmp_path / "draft")
    prompts = word_prompts(tp_ckpt, n=4)
    with LLM(str(tp_ckpt), device="cpu", max_seq_len=128) as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    with LLM(str(tp_ckpt), device="cpu", max_seq_len=128, tensor_parallel_size=2, tensor_parallel_draft="sharded",
             use_speculative_decoding=True, draft_model=str(draft), spec_length=K) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.runner.stats.acceptance_rate > 0.9
        assert llm.engine.leak_report() == []
        workers = llm.engine.parallel.workers
    assert len(workers) == 1 and workers[0].returncode == 0  # (rank 1; this process is rank 0)


def test_a_fault_mapping_one_request_fails_it_alone(make_llm, ckpt_a, foreign, prompts, plain_outputs, monkeypatch):
    real_propose, real_map = ForeignDraftProposer.propose, ForeignDraftProposer.to_target

    def propose(self, requests, shape, depths):  # (drafts are mapped in the order of `requests`)
        self.rows = iter(r.sampling_params.greedy for r in requests)
        return real_propose(self, requests, shape, depths)

    def to_target(self, draft):
        if not next(self.rows):  # the one sampled request's
            raise RuntimeError("injected mapping failure")
        return real_map(self, draft)

    monkeypatch.setattr(ForeignDraftProposer, "propose", propose)
    monkeypatch.setattr(ForeignDraftProposer, "to_target", to_target)
    llm = spec_llm(make_llm, ckpt_a, foreign, 8)
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert outs[1].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == plain_outputs[:1] + plain_outputs[2:]
