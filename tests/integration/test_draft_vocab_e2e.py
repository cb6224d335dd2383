"""A reduced draft vocabulary (spec_draft_vocab) end to end: greedy parity with plain
decoding, and losslessness of sampling (the empirical joint of the first three tokens
against the target's exact one, helpers/joint.py) on a 4-token vocabulary whose draft keeps
2 tokens; a draft of another vocabulary keeping the table's tokens at its own ids. Negative
control: the draft sampling its whole vocabulary and its proposals
outside the table dropped (q not zero there) fails the same bound.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from helpers.joint import empirical_joint, exact_joint, seeded, tiny_pair, total_variation
from helpers.spec_e2e import run, spec_llm
from infer import SamplingParams
from infer.models.llama import LlamaForCausalLM
from infer.speculative.draft_model import DraftModelProposer
from infer.speculative.draft_vocab import DraftVocab, build_table

VOCAB = 4
KEPT = (0, 2)
PROMPT = [2, 3, 2]
N = 6000
N_CONTROL = 3000
TV_LIMIT = 0.07  # expected sampling noise for 64 cells at N = 6000 is about 0.03
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory, VOCAB)


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "table.json"
    DraftVocab(KEPT, VOCAB, "test", 0, 0.0).save(path)
    return str(path)


def _llm(make_llm, pair, table):
    target, draft = pair
    return make_llm(target, max_batch_size=64, max_seq_len=16, use_speculative_decoding=True,
                    draft_model=str(draft), spec_length=3, spec_draft_vocab=table)


def _tv(llm, target, n: int) -> float:
    exact = exact_joint(target, PROMPT, T1, VOCAB)
    assert max(exact.values()) < 0.5, "distribution too peaked to be a meaningful test"
    outputs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=seeded(T1, n))
    return total_variation(empirical_joint(outputs), exact)


def test_sampling_matches_target(make_llm, pair, small_table):
    llm = _llm(make_llm, pair, small_table)
    draft = llm.engine.models.draft
    assert draft.kept_ids.tolist() == list(KEPT) and draft.lm_head.out_features == len(KEPT)
    assert _tv(llm, pair[0], N) < TV_LIMIT
    stats = llm.engine.runner.stats
    assert stats.draft_tokens > 0 and 0 < stats.accepted_tokens < 0.95 * stats.draft_tokens


def test_negative_control_dropped_proposals_fail(make_llm, pair, small_table, monkeypatch):
    # the draft keeps its whole head (its q nonzero outside the table) and a proposal outside
    # the table is dropped with what follows it: the proposals kept are not drawn from q
    monkeypatch.setattr(LlamaForCausalLM, "keep_vocab", lambda self, ids: None)
    propose = DraftModelProposer.propose

    def cut(self, requests, shape, depths):
        drafts = propose(self, requests, shape, depths)
        out = []
        for d in drafts:
            valid = list(d.valid)
            for node, token in enumerate(d.token_ids):
                parent = d.shape.parents[node]
                valid[node] = valid[node] and token in KEPT and (parent < 0 or valid[parent])
            tokens = tuple(t if ok else 0 for t, ok in zip(d.token_ids, valid, strict=True))
            out.append(replace(d, host_ids=tokens, valid=tuple(valid)))
        return out

    monkeypatch.setattr(DraftModelProposer, "propose", cut)
    assert _tv(_llm(make_llm, pair, small_table), pair[0], N_CONTROL) > TV_LIMIT


def _table(tmp_path, outputs, drop: int = 0) -> str:
    """A table of the outputs' tokens, less the `drop` most frequent."""
    counts = Counter(t for out in outputs for t in out)
    kept = [t for t, _ in counts.most_common()][drop:]
    path = tmp_path / f"table{drop}.json"
    build_table(Counter({t: counts[t] for t in kept}), len(kept), 384, "outputs").save(path)
    return str(path)


@pytest.mark.parametrize("drop", [0, 1], ids=["every-output-token", "most-frequent-left-out"])
def test_greedy_parity(make_llm, ckpt_a, prompts, plain_outputs, tmp_path, drop):
    # the target as its own draft: every proposal is accepted while the table holds the
    # tokens it needs, and one left out costs acceptance, never the output
    llm = spec_llm(make_llm, ckpt_a, ckpt_a, 8, spec_draft_vocab=_table(tmp_path, plain_outputs, drop))
    outs = run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    rate = llm.engine.runner.stats.acceptance_rate
    assert rate >= 0.99 if drop == 0 else rate < 0.9
    assert llm.engine.leak_report() == []


def test_reduced_logits_are_the_whole_heads_rows(ckpt_a):
    from infer.models.loading.loader import load_model

    model, _ = load_model(str(ckpt_a), dtype="float32")
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.logits(hidden)
    ids = torch.tensor([5, 1, 300, 7])
    model.keep_vocab(ids)
    reduced = model.logits(hidden)
    assert reduced.shape == whole.shape
    torch.testing.assert_close(reduced[:, ids], whole[:, ids])
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(reduced[:, outside]).all()
    with pytest.raises(ValueError, match="reduced already"):
        model.keep_vocab(ids)


@pytest.mark.parametrize(("quantization", "stored", "tolerance"), [("fp8", "fp8", 0.08), ("int4", "int8", 0.0)])
def test_a_quantized_drafts_reduced_head_is_quantized_as_the_draft(ckpt_a, quantization, stored, tolerance):
    # the gathered head of an FP8 draft is FP8, its logits the whole (unquantized) head's rows
    # within FP8's error; an int4 draft's is 8-bit as its whole head is: the same values
    from infer.models.loading.loader import load_model

    model, _ = load_model(str(ckpt_a), dtype="float32", quantization=quantization)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    whole = model.logits(hidden)
    ids = torch.tensor([5, 1, 300, 7, 64, 65])
    model.keep_vocab(ids)
    assert model.lm_head.quantization == stored and model.lm_head.out_features == len(ids)
    reduced = model.logits(hidden)
    scale = whole[:, ids].abs().max()
    torch.testing.assert_close(reduced[:, ids], whole[:, ids], atol=float(tolerance * scale), rtol=0)
    assert torch.equal(reduced[:, ids], whole[:, ids]) == (tolerance == 0)  # (FP8: not the whole head's values)
    assert torch.isneginf(reduced[:, [i for i in range(model.config.vocab_size) if i not in ids.tolist()]]).all()


def test_another_vocabulary_keeps_the_tables_tokens(make_llm, ckpt_a, prompts, plain_outputs, tmp_path):
    # the target under shuffled ids drafts exactly as itself: with a table of the tokens its
    # outputs need, kept at their draft ids, every proposal is still accepted
    from helpers.foreign_vocab import permuted_draft

    draft = permuted_draft(ckpt_a, tmp_path / "permuted")
    llm = spec_llm(make_llm, ckpt_a, draft, 8, spec_draft_vocab=_table(tmp_path, plain_outputs))
    proposer = llm.engine.runner.speculation.proposer
    kept = llm.engine.models.draft.kept_ids.tolist()
    assert sorted(proposer.vocab.draft_to_target[x] for x in kept) == sorted({t for o in plain_outputs for t in o})
    outs = run(llm, prompts, 8)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    assert llm.engine.runner.stats.acceptance_rate >= 0.99


def test_the_shipped_demo_table_by_name_keeps_the_demo_pairs_greedy_output(make_llm):
    from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def"]
    plain = make_llm(DEMO_TARGET, max_seq_len=128)
    llm = make_llm(DEMO_TARGET, max_seq_len=128, draft_model=str(DEMO_DRAFT), spec_length=4,
                   spec_draft_vocab="demo-6k")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got, want = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    draft = llm.engine.runner.speculation.proposer.model
    assert draft.lm_head.out_features == 6144 and llm.engine.runner.stats.accepted_tokens > 0


def test_the_shipped_llama3_table_fits_a_llama3_target_from_its_config_alone():
    from infer.engine.config import EngineConfig
    from infer.engine.loading import draft_vocab_table, load_part
    from infer.speculative.draft_vocab import SHIPPED, load_table

    table = load_table("llama3-32k")
    assert table.size == 32768 and table.vocab_size == 128256 and {128001, 128008, 128009} <= set(table.token_ids)
    config = EngineConfig(model="dummy:llama-3.2-3b", draft_model="dummy:llama-3.2-1b", device="cpu",
                          use_speculative_decoding=True, spec_draft_vocab="llama3-32k")
    assert draft_vocab_table(load_part(config, torch.device("cpu"))) == table
    with pytest.raises(ValueError, match="for a vocabulary of 128256 tokens, the target has 8192"):
        draft_vocab_table(load_part(EngineConfig(use_speculative_decoding=True, spec_draft_vocab="llama3-32k",
                                                 device="cpu"), torch.device("cpu")))
    with pytest.raises(ValueError, match=", ".join(SHIPPED)):
        EngineConfig(use_speculative_decoding=True, spec_draft_vocab="llama3-64k", device="cpu")
