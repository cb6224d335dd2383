"""Unit tests for infer.sampling: parameter validation, each logits transform, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from infer.sampling import (
    SamplingParams,
    adjust_logits,
    draw_uniforms,
    logits_to_probs,
    make_generator,
    sample,
    sample_from_probs,
    sample_without_replacement,
)

NEG_INF = float("-inf")


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs], dtype=torch.float64).log().float()  # [1, V]


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("ignore_eos", "yes"),
        ("seed", 1.5),
        ("seed", 2**64),
    ],
)
def test_invalid_parameter_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_valid_parameters_are_normalised() -> None:
    p = SamplingParams(temperature=1, stop="###", stop_token_ids=[2, 7], top_k=0, seed=-3)
    assert p.stop == ("###",)
    assert p.stop_token_ids == (2, 7)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


# ---------------------------------------------------------------- transforms


def test_repetition_penalty_only_on_context_ids_with_sign_rule() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5],
                           [2.0, -2.0, 1.0, -1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(repetition_penalty=2.0)]
    out = adjust_logits(logits, params, [[0, 1, 1], []])
    # positive logit divided, negative logit multiplied, others untouched, repeated id once
    assert torch.equal(out[0], torch.tensor([1.0, -4.0, 1.0, -1.0, 0.5]))
    assert torch.equal(out[1], logits[1])  # empty context: nothing penalised
    assert torch.equal(adjust_logits(logits, params, None), logits)
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5]))  # input untouched


def test_repetition_penalty_below_one_boosts() -> None:
    out = adjust_logits(torch.tensor([[2.0, -2.0, 1.0]]), [SamplingParams(repetition_penalty=0.5)], [[0, 1]])
    assert torch.equal(out[0], torch.tensor([4.0, -1.0, 1.0]))


def test_tensor_contexts_match_list_contexts() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(repetition_penalty=1.7)] * 3
    lists = [[1, 2, 2, 49], [], [0, 7]]
    tensors = [torch.tensor(c, dtype=torch.long) for c in lists]
    assert torch.equal(adjust_logits(logits, params, lists), adjust_logits(logits, params, tensors))
    assert not torch.equal(adjust_logits(logits, params, lists), logits)


def test_context_id_outside_vocab_raises() -> None:
    with pytest.raises(ValueError, match="contexts"):
        adjust_logits(torch.zeros(1, 4), [SamplingParams(repetition_penalty=1.2)], [[4]])


def test_temperature_scales_and_greedy_rows_unscaled() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]])
    out = adjust_logits(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)], None)
    assert torch.allclose(out[0], torch.tensor([4.0, -2.0, 1.0]))
    assert torch.equal(out[1], logits[1])


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    out = adjust_logits(logits, [SamplingParams(top_k=2)], None)
    assert torch.equal(out[0], torch.tensor([3.0, NEG_INF, 2.0, NEG_INF, NEG_INF]))
    for off in (-1, 0, 5, 100):
        assert torch.equal(adjust_logits(logits, [SamplingParams(top_k=off)], None), logits)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    out = adjust_logits(torch.tensor([[3.0, 2.0, 0.0, 2.0]]), [SamplingParams(top_k=2)], None)
    assert torch.equal(out[0], torch.tensor([3.0, 2.0, NEG_INF, 2.0]))


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = _logits_of([0.05, 0.5, 0.15, 0.3])
    keep_075 = adjust_logits(logits, [SamplingParams(top_p=0.75)], None)[0]
    assert torch.isfinite(keep_075).tolist() == [False, True, False, True]
    keep_085 = adjust_logits(logits, [SamplingParams(top_p=0.85)], None)[0]
    assert torch.isfinite(keep_085).tolist() == [False, True, True, True]
    probs = logits_to_probs(logits, [SamplingParams(top_p=0.75)], None)[0]
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]))


def test_top_p_keeps_at_least_the_top_token() -> None:
    logits = _logits_of([0.2, 0.7, 0.1])
    probs = logits_to_probs(logits, [SamplingParams(top_p=1e-6)], None)[0]
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_top_p_keeps_all_tokens_tied_with_last_kept() -> None:
    logits = _logits_of([0.2, 0.4, 0.2, 0.2])
    # 0.4 alone is below 0.5, the next token is one of three equal ones: all three are kept
    kept = torch.isfinite(adjust_logits(logits, [SamplingParams(top_p=0.5)], None)[0])
    assert kept.all()
    logits2 = _logits_of([0.1, 0.3, 0.3, 0.3])
    kept2 = torch.isfinite(adjust_logits(logits2, [SamplingParams(top_p=0.2)], None)[0])
    assert kept2.tolist() == [False, True, True, True]


def test_top_k_applies_before_top_p() -> None:
    logits = _logits_of([0.4, 0.3, 0.2, 0.1])
    # top-p alone at 0.75: mass before token 2 is 0.7 < 0.75 -> keeps {0, 1, 2};
    # after top-k = 3 the renormalised mass before token 2 is 0.7 / 0.9 > 0.75 -> keeps {0, 1}
    alone = torch.isfinite(adjust_logits(logits, [SamplingParams(top_p=0.75)], None)[0])
    both = torch.isfinite(adjust_logits(logits, [SamplingParams(top_k=3, top_p=0.75)], None)[0])
    assert alone.tolist() == [True, True, True, False]
    assert both.tolist() == [True, True, False, False]


def test_greedy_probs_one_hot_at_penalised_argmax() -> None:
    logits = torch.tensor([[2.0, 1.5, -3.0], [2.0, 1.5, -3.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    probs = logits_to_probs(logits, params, [[0], [0]])
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_mixed_rows_match_rows_processed_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen) * 3  # [5, 40]
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.1),
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=8, top_p=0.5),
    ]
    contexts = [[1, 2], [3, 3, 4], [5, 39], [], [0]]
    batch = logits_to_probs(logits, params, contexts)
    for i in range(5):
        alone = logits_to_probs(logits[i:i + 1], [params[i]], [contexts[i]])
        assert torch.allclose(batch[i], alone[0], atol=1e-7)
    # hand check of row 0: temperature then top-5
    expected = torch.softmax(logits[0] / 0.7, -1)
    expected[expected < expected.topk(5).values[-1]] = 0
    assert torch.allclose(batch[0], expected / expected.sum(), atol=1e-6)
    assert torch.allclose(batch.sum(-1), torch.ones(5))
    assert int((batch[0] > 0).sum()) == 5 and int((batch[1] > 0).sum()) == 1


def test_adjust_logits_returns_float32_from_other_dtypes() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    out = adjust_logits(logits, [SamplingParams(temperature=0.5)], None)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.tensor([[2.0, 4.0, 6.0]]))


def test_batch_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="params"):
        adjust_logits(torch.zeros(2, 3), [SamplingParams()], None)


# ---------------------------------------------------------------- sampling


def test_inverse_cdf_picks_first_index_exceeding_u() -> None:
    probs = torch.tensor([[0.25, 0.5, 0.0, 0.25]]).expand(6, 4)
    u = torch.tensor([0.0, 0.2, 0.25, 0.74, 0.75, 0.99], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [0, 0, 1, 1, 3, 3]


def test_never_picks_zero_probability_token() -> None:
    top = 1.0 - 2.0**-53  # the largest float64 below 1
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1e-30, 0.0, 0.0],
                          [0.1, 0.2, 0.3, 0.0]])
    for u in (0.0, 0.5, top):
        ids = sample_from_probs(probs, torch.full((4,), u, dtype=torch.float64))
        assert (probs[torch.arange(4), ids] > 0).all(), u
    gen = torch.Generator().manual_seed(1)
    many = torch.rand(2000, 50, generator=gen) * (torch.rand(2000, 50, generator=gen) < 0.2)  # [2000, 50]
    many[:, 0] += (many.sum(-1) == 0).float()  # every row needs some mass
    u = torch.cat([torch.full((1000,), top, dtype=torch.float64),
                   torch.rand(1000, generator=gen, dtype=torch.float64)])
    ids = sample_from_probs(many, u)
    assert (many[torch.arange(2000), ids] > 0).all()


def test_unnormalised_probs_sample_the_same() -> None:
    probs = torch.tensor([[0.2, 0.3, 0.5]])
    u = torch.tensor([0.45], dtype=torch.float64)
    assert sample_from_probs(probs * 7.0, u).tolist() == sample_from_probs(probs, u).tolist() == [1]


def test_empirical_frequencies_match_probs() -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.tensor([0.3, 0.0, 0.15, 0.05, 0.2, 0.1, 0.0, 0.12, 0.08])  # [9]
    n = 200_000
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ids = sample_from_probs(probs.expand(n, -1), u)
    freq = torch.bincount(ids, minlength=9).double() / n
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.01
    assert freq[1] == 0 and freq[6] == 0


def test_draws_without_replacement_are_distinct_and_each_from_the_renormalised_rest() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.tensor([0.4, 0.0, 0.3, 0.2, 0.1])  # [5]
    n = 200_000
    ids, dists, drawn = sample_without_replacement(probs.expand(n, -1),
                                                   torch.rand(n, 2, generator=gen, dtype=torch.float64))
    assert bool(drawn.all()) and bool((ids[:, 0] != ids[:, 1]).all()) and not bool((ids == 1).any())
    assert torch.equal(dists[:, 0], probs.expand(n, -1))  # the first draw: probs itself
    rest = probs.expand(n, -1).scatter(1, ids[:, :1], 0.0)
    assert torch.allclose(dists[:, 1], rest / rest.sum(-1, keepdim=True))  # the second: the rest, renormalised
    # the second draw's frequencies given the first match that renormalised rest
    first = ids[:, 0] == 0
    freq = torch.bincount(ids[first, 1], minlength=5).double() / int(first.sum())
    assert 0.5 * (freq - torch.tensor([0.0, 0.0, 0.5, 1 / 3, 1 / 6], dtype=torch.float64)).abs().sum() < 0.01


def test_a_draw_that_finds_no_mass_left_is_absent() -> None:
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, 4]
    u = torch.full((2, 3), 0.5, dtype=torch.float64)
    ids, dists, drawn = sample_without_replacement(probs, u)
    assert drawn.tolist() == [[True, True, False], [True, True, True]]
    assert sorted(ids[0, :2].tolist()) == [1, 2] and ids[0, 2] == 0 and bool((dists[0, 2] == 0).all())
    assert len(set(ids[1].tolist())) == 3
    with pytest.raises(ValueError, match="uniforms"):
        sample_without_replacement(probs, u[0])


def test_draw_uniforms_rows_come_from_their_own_generator() -> None:
    a1, a2, b = make_generator(5), make_generator(5), make_generator(6)
    together = draw_uniforms([a1, b], 4)
    alone = draw_uniforms([a2], 4)
    assert together.shape == (2, 4) and together.dtype == torch.float64
    assert torch.equal(together[0], alone[0])
    assert not torch.equal(together[0], together[1])
    assert ((together >= 0) & (together < 1)).all()
    assert draw_uniforms([], 3).shape == (0, 3)


def test_unseeded_generators_differ() -> None:
    first = draw_uniforms([make_generator(None)], 8)
    second = draw_uniforms([make_generator(None)], 8)
    assert not torch.equal(first, second)


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0, seed=11)]

    def run(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [int(sample(logits, params, None, [gen])[0]) for _ in range(30)]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_sample_greedy_rows_are_argmax_and_sampled_rows_follow_params() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 20, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=3)]
    gens = [make_generator(i) for i in range(3)]
    top3 = set(logits[2].topk(3).indices.tolist())
    for _ in range(20):
        ids = sample(logits, params, None, gens).tolist()
        assert ids[0] == int(logits[0].argmax()) and ids[1] == int(logits[1].argmax())
        assert ids[2] in top3


def test_temperature_changes_entropy_as_expected() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    cold = logits_to_probs(logits, [SamplingParams(temperature=0.5)], None)[0]
    expected = torch.tensor([math.exp(2), 1.0, math.exp(-2)])
    assert torch.allclose(cold, (expected / expected.sum()).float())


def test_temperature_probs_equals_the_general_pipeline():
    from infer.sampling import temperature_only, temperature_probs
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 40, generator=g) * 3
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.5, top_k=40), SamplingParams(temperature=0, top_p=0.5)]
    assert all(temperature_only(p, 40) for p in params)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(temperature_probs(logits, temps, greedy), logits_to_probs(logits, params, None))
    assert not temperature_only(SamplingParams(temperature=1.0, top_k=5), 40)
    assert not temperature_only(SamplingParams(temperature=1.0, top_p=0.9), 40)
    assert not temperature_only(SamplingParams(temperature=0, repetition_penalty=1.2), 40)


def test_rows_without_a_valid_distribution_sample_no_token():
    from infer.sampling import NO_TOKEN, greedy_tokens, one_hot_max, sample_from_probs, temperature_probs
    logits = torch.tensor([[0.0, 2.0, 1.0], [float("nan"), 1.0, 0.0], [float("-inf")] * 3, [0.0, float("inf"), 1.0]])
    assert greedy_tokens(logits).tolist() == [1, NO_TOKEN, NO_TOKEN, NO_TOKEN]
    assert torch.isnan(one_hot_max(logits)[1:]).all() and one_hot_max(logits)[0].tolist() == [0.0, 1.0, 0.0]
    probs = temperature_probs(logits, torch.ones(4), torch.tensor([False, False, False, True]))
    assert sample_from_probs(probs, torch.full((4,), 0.5, dtype=torch.float64))[1:].tolist() == [NO_TOKEN] * 3
    zero = torch.zeros(1, 3)  # nothing allowed
    assert sample_from_probs(zero, torch.tensor([0.3], dtype=torch.float64)).tolist() == [NO_TOKEN]
