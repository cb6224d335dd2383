"""Log-probabilities of emitted tokens and the OpenAI presence / frequency penalties, as
pure functions, against hand-written references."""

from __future__ import annotations

import math

import pytest
import torch

from infer.logprobs import emitted_logprobs, token_logprobs
from infer.sampling import SamplingParams, derive_seed, logits_to_probs


def test_token_logprobs_are_the_raw_log_softmax_with_top_n() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    out = token_logprobs(logits, [1, 2, 0], [2, 0, None])
    norm0 = math.log(sum(math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)))
    assert out[0] is not None and out[0].token_id == 1
    assert out[0].logprob == pytest.approx(1.0 - norm0, abs=1e-6)
    assert [t for t, _ in out[0].top] == [0, 1]
    assert out[0].top[0][1] == pytest.approx(2.0 - norm0, abs=1e-6)
    assert out[1] is not None and out[1].top == ()  # 0 alternatives: the sampled token alone
    assert out[2] is None  # that row asked for none


def test_emitted_logprobs_take_token_j_from_position_j() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    out = emitted_logprobs(logits, [[4, 1], [0, 2, 3]], [1, None])
    assert out is not None and out[1] == []
    ref = torch.log_softmax(logits[0], dim=-1)
    assert [e.logprob for e in out[0]] == pytest.approx([ref[0, 4].item(), ref[1, 1].item()], abs=1e-6)
    assert emitted_logprobs(logits, [[1], [2]], [None, None]) is None


def _hand_penalised(logits: list[float], context: list[int], rep: float, pres: float, freq: float) -> list[float]:
    out = list(logits)
    for token in set(context):
        v = out[token]
        v = v / rep if v > 0 else v * rep
        out[token] = v - context.count(token) * freq - pres
    return out


@pytest.mark.parametrize("rep, pres, freq", [(1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (1.3, -0.4, 0.9)])
def test_presence_and_frequency_penalties_match_openai_formula(rep: float, pres: float, freq: float) -> None:
    logits = [1.5, -0.5, 0.25, 2.0, -1.0]
    context = [3, 3, 1, 0, 3]
    params = SamplingParams(temperature=0.5, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    want = torch.softmax(torch.tensor(_hand_penalised(logits, context, rep, pres, freq)) / 0.5, dim=-1)
    plain = SamplingParams(temperature=0.5)
    got = logits_to_probs(torch.tensor([logits, logits]), [params, plain], [context, context])
    assert got[0].tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert got[1].tolist() == pytest.approx(torch.softmax(torch.tensor(logits) / 0.5, dim=-1).tolist(), abs=1e-6)


def test_greedy_rows_take_the_penalised_argmax() -> None:
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    probs = logits_to_probs(torch.tensor([[3.0, 2.0, 0.0]]), [params], [[0, 0]])  # 3 - 4 < 2
    assert probs[0].tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("logprobs", 21),
                                          ("logprobs", -1), ("presence_penalty", "x")])
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_derived_seeds_are_distinct_and_keep_the_first() -> None:
    assert derive_seed(None, 3) is None
    assert derive_seed(7, 0) == 7
    seeds = {derive_seed(7, i) for i in range(1, 100)} | {derive_seed(8, i) for i in range(1, 100)}
    assert len(seeds) == 198 and all(0 <= s < 2**63 for s in seeds)


def test_formatter_shows_partial_utf8_tokens_as_bytes() -> None:
    from infer.engine.loading import DEMO_TARGET
    from infer.logprobs import TokenLogprobs
    from infer.server.logprob_format import LogprobFormatter
    from infer.tokenization import Tokenizer

    tok = Tokenizer.from_pretrained(DEMO_TARGET)
    fmt = LogprobFormatter(tok)
    euro = tok.encode("€", add_special_tokens=False)  # 3 UTF-8 bytes
    partial = [t for t in euro if (b := tok.token_bytes(t)) is not None and not _utf8(b)]
    assert partial, "the demo vocabulary should split '€' into byte tokens"
    assert fmt.token(partial[0]).startswith("bytes:\\x")
    assert b"".join(bytes(fmt.token_bytes(t)) for t in euro) == "€".encode()
    hello = tok.encode(" hello", add_special_tokens=False)
    assert "".join(fmt.token(t) for t in hello) == " hello"
    out = fmt.completion([TokenLogprobs(hello[0], float("-inf"), ((hello[0], float("-inf")),))], 4, True)
    assert out.token_logprobs == [-9999.0] and out.text_offset == [4]


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
