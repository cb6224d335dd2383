"""`LLM.generate`'s inputs (CPU, tiny checkpoint): every prompt is checked before any is
queued, so an invalid prompt leaves nothing behind; token ids must be integers (a flat
list is one prompt, NumPy and torch integer arrays are taken); sampling_params must be
SamplingParams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(ckpt_a):
    from infer import LLM
    return LLM(str(ckpt_a), device="cpu", max_seq_len=64)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_an_invalid_prompt_leaves_the_valid_ones_behind_it_unqueued(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[0, 5, 6], [0, 999]], sampling_params=GREEDY)
    assert llm.engine.leak_report() == []
    assert not llm.engine.has_unfinished()
    # the next call computes its own prompt only
    assert len(llm.generate(prompt_token_ids=[[0, 5, 6]], sampling_params=GREEDY)) == 1
    assert llm.engine.leak_report() == []


def test_a_refusal_while_queueing_takes_back_what_was_queued(llm, monkeypatch):
    real = llm.engine.add_request
    calls = []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", fail_third)
    with pytest.raises(ValueError, match="refused"):
        llm.generate(prompt_token_ids=[[0, 5], [0, 6], [0, 7]], sampling_params=GREEDY)
    assert llm.engine.leak_report() == [] and not llm.engine.has_unfinished()


def test_a_flat_list_of_ids_is_one_prompt_and_integer_arrays_are_taken(llm):
    want = tokens(llm.generate(prompt_token_ids=[[0, 5, 6]], sampling_params=GREEDY))
    assert tokens(llm.generate(prompt_token_ids=[0, 5, 6], sampling_params=GREEDY)) == want
    assert tokens(llm.generate(prompt_token_ids=np.array([[0, 5, 6]]), sampling_params=GREEDY)) == want
    assert tokens(llm.generate(prompt_token_ids=[torch.tensor([0, 5, 6])], sampling_params=GREEDY)) == want
    assert tokens(llm.generate(prompt_token_ids=[np.array([0, 5, 6], dtype=np.int32)], sampling_params=GREEDY)) == want


@pytest.mark.parametrize("ids, message", [
    ([[0, 5.0, 6]], "5.0"),
    ([[0, True, 6]], "True"),
    ([np.array([0.0, 5.0])], "float"),
    ([["0", "5"]], "'0'"),
    ("0 5 6", "list of prompts"),
    (5, "list of prompts"),
    ([[0, 5], 7], r"prompt_token_ids\[1\] is 7, not a list"),
])
def test_token_ids_that_are_not_integers_are_refused(llm, ids, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert llm.engine.leak_report() == []


@pytest.mark.parametrize("params, message", [
    ({"temperature": 0}, "SamplingParams or a list"),
    ([GREEDY, {"max_tokens": 2}], "holds a dict"),
    ("greedy", "SamplingParams or a list"),
])
def test_sampling_params_of_the_wrong_type_are_refused(llm, params, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompt_token_ids=[[0, 5], [0, 6]], sampling_params=params)
    assert llm.engine.leak_report() == []


def test_text_prompts_must_be_strings(llm):
    with pytest.raises(TypeError, match="prompts are strings"):
        llm.generate([[0, 5, 6]], GREEDY)
