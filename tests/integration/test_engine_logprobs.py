"""Log-probabilities and presence / frequency penalties end to end, against a reference
decoded from the model's own logits (a full forward per token, no cache, penalties and
inverse-CDF sampling written out here): greedy, seeded sampling, and under speculative
decoding (a draft model and n-gram drafts), where the reported log-probabilities must be
the target's at every emitted position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.reference import TOP, reference
from infer import SamplingParams
from infer.models.loading.loader import load_model

PROMPT = "The quick brown fox"
STEPS = 12


@pytest.fixture(scope="module")
def model(ckpt_a: Path) -> torch.nn.Module:
    return load_model(str(ckpt_a), dtype="float32")[0]


SETTINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP),
    "greedy-penalties": SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP,
                                       presence_penalty=1.5, frequency_penalty=1.0),
    "seeded": SamplingParams(temperature=0.9, max_tokens=STEPS, ignore_eos=True, logprobs=TOP, seed=11),
    "seeded-penalties": SamplingParams(temperature=0.9, max_tokens=STEPS, ignore_eos=True, logprobs=TOP, seed=5,
                                       presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.2),
}
SPEC = {"plain": {}, "draft": {"use_speculative_decoding": True, "spec_length": 3},
        "ngram": {"use_speculative_decoding": True, "speculative_method": "prompt_lookup", "spec_length": 3,
                  "ngram_min_order": 2}}


def check_logprobs(out: Any, want: list[Any]) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for entry, token, (lp, top) in zip(out.logprobs, out.token_ids, want, strict=True):
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in entry.top] == top
        assert entry.top[0][1] >= entry.logprob - 1e-6


@pytest.mark.parametrize("spec", list(SPEC))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_tokens_and_logprobs_equal_the_reference(make_llm: Any, ckpt_a: Path, model: torch.nn.Module,
                                                 name: str, spec: str) -> None:
    params = SETTINGS[name]
    extra = dict(SPEC[spec])
    if spec == "draft":
        extra["draft_model"] = str(ckpt_a)  # the target drafts for itself
    llm = make_llm(ckpt_a, **extra)
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    if spec != "plain" and not params.greedy:
        # speculation draws its uniforms per round: other tokens, the same target model,
        # so every reported log-probability must be the target's at that prefix
        _, want = reference_along(model, prompt, out.token_ids)
        check_logprobs(out, want)
        return
    tokens, want = reference(model, prompt, params)
    assert out.token_ids == tokens
    check_logprobs(out, want)
    if spec == "draft" or (spec == "ngram" and not params.penalized):  # (penalised text rarely repeats)
        assert llm.engine.runner.stats.draft_tokens > 0


def reference_along(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[Any]]:
    lps = []
    with torch.no_grad():
        for i, token in enumerate(tokens):
            log_probs = torch.log_softmax(model(torch.tensor([prompt + tokens[:i]]))[0, -1].float(), dim=-1)
            lps.append((log_probs[token].item(), log_probs.topk(TOP).indices.tolist()))
    return tokens, lps


def test_penalties_change_greedy_output(make_llm: Any, ckpt_a: Path) -> None:
    llm = make_llm(ckpt_a)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    penal = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    a, b = (o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT], [plain, penal]))
    assert a != b
    assert max(b.count(t) for t in set(b)) <= max(a.count(t) for t in set(a))


def test_no_logprobs_unless_asked(make_llm: Any, ckpt_a: Path) -> None:
    out = make_llm(ckpt_a).generate([PROMPT], SamplingParams(max_tokens=3))[0].outputs[0]
    assert out.logprobs is None
