"""Losslessness tests for infer.speculative.verifier (speculative verification).

The statistical tests run full speculative decoding on a synthetic "language": a Markov
chain whose next-token distribution depends on the absolute position and the previous
token, for the target (p) and the draft (q) alike. The exact marginal of the target at
every position is a product of transition matrices, so each emitted position can be
compared with it. Rows of the batch are independent trials (>= 100,000 per distribution),
each generating `LENGTH` tokens over several rounds, so round boundaries, partial
acceptance, recovery and bonus tokens are all exercised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from infer.sampling import SamplingParams, logits_to_probs, sample_from_probs
from infer.speculative.verifier import (
    VerifyResult,
    residual_distribution,
    unpack_rows,
    verify,
    verify_greedy_logits,
    verify_logits,
    verify_tensors,
)

TV_BOUND = 0.01
LENGTH = 6  # tokens generated per trial
PAD = 10**9  # garbage in padded draft slots: must never be read

Verifier = Callable[..., VerifyResult]


# ---------------------------------------------------------------- pure helpers


def _accepted(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, u: list[float]) -> list[bool]:
    """Whether `verify_tensors` accepts a one-token draft per row: p, q [B, V], tokens [B], u [B]."""
    b = tokens.shape[0]
    target = torch.stack([p, p], dim=1)  # [B, 2, V]: the draft's position, then the bonus
    packed = verify_tensors(tokens[:, None], torch.ones(b, dtype=torch.long), None if q is None else q[:, None],
                            target, torch.tensor(u, dtype=torch.float64)[:, None], torch.zeros(b, dtype=torch.float64))
    return (packed[:, 1] == 1).tolist()  # [B]: the number accepted


def _assert_accepts_below(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, want: list[float]) -> None:
    """A draft is accepted with probability `want`: exactly for uniforms below it."""
    below = [max(0.0, w - 1e-6) for w in want]
    at = [min(w, 1 - 1e-12) for w in want]
    assert _accepted(p, q, tokens, below) == [w > 0 for w in want]
    assert _accepted(p, q, tokens, at) == [w >= 1 for w in want]


def test_a_draft_is_accepted_with_probability_min_one_p_over_q() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64).expand(5, -1)
    q = torch.tensor([0.25, 0.6, 0.0, 0.15, 0.0], dtype=torch.float64).expand(5, -1)
    tokens = torch.tensor([0, 1, 2, 3, 4])
    # p/q = 2 -> 1; 0.5; q = 0 < p -> 1; p = 0 -> 0; p = q = 0 -> 0
    _assert_accepts_below(p, q, tokens, [1.0, 0.5, 1.0, 0.0, 0.0])
    _assert_accepts_below(p, None, tokens, [0.5, 0.3, 0.2, 0.0, 0.0])  # a one-hot proposal: p(t)


def test_acceptance_probabilities_batched_random() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(12, 7, generator=gen), -1)  # [12, 7]
    q = torch.softmax(torch.randn(12, 7, generator=gen), -1)  # [12, 7]
    t = torch.randint(0, 7, (12,), generator=gen)  # [12]
    want = [min(1.0, float(p[i, t[i]]) / float(q[i, t[i]])) for i in range(12)]
    assert 0 < sum(w < 1 for w in want) < 12  # both sides of the min
    _assert_accepts_below(p, q, t, want)


def test_residual_distribution_hand_built_and_fallback() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.25, 0.6, 0.0, 0.15])
    res = residual_distribution(p, q)
    assert torch.allclose(res, torch.tensor([5 / 9, 0.0, 4 / 9, 0.0], dtype=torch.float64))
    assert torch.equal(residual_distribution(p, p), p.double() / p.double().sum())
    one_hot_q = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert torch.allclose(residual_distribution(p, one_hot_q),
                          torch.tensor([5 / 7, 0.0, 2 / 7, 0.0], dtype=torch.float64))


# ---------------------------------------------------------------- verify, deterministic cases


def test_uniforms_below_ratio_accept_and_first_rejection_stops() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])  # per position
    q = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.6, 0.3]])
    drafts = torch.tensor([[0, 1]])
    # ratios: position 0: 0.5 / 1 = 0.5; position 1: 0.3 / 0.6 = 0.5
    cases = [([0.4, 0.4], 2, [0, 1, 2]),  # both accepted, bonus from p_2 = one-hot(2)
             ([0.4, 0.6], 1, None),  # rejected at 1
             ([0.6, 0.0], 0, None)]  # rejected at 0 -> residual max(0, p0 - q0) = one-hot(1)
    for u, n, expected in cases:
        res = verify(drafts, [2], q[None], p[None], torch.tensor([u]), torch.tensor([0.3]))
        assert res.num_accepted == [n]
        assert res.tokens[0][:n] == drafts[0, :n].tolist() and len(res.tokens[0]) == n + 1
        if expected is not None:
            assert res.tokens[0] == expected
    rejected_at_0 = verify(drafts, [2], q[None], p[None], torch.tensor([[0.6, 0.0]]), torch.tensor([0.99]))
    assert rejected_at_0.tokens == [[1]]
    # residual at position 1: max(0, [0.2, 0.3, 0.5] - [0.1, 0.6, 0.3]) = [0.1, 0, 0.2] -> u = 0.3 picks 0
    rejected_at_1 = verify(drafts, [2], q[None], p[None], torch.tensor([[0.4, 0.6]]), torch.tensor([0.3]))
    assert rejected_at_1.tokens == [[0, 0]]


def test_zero_drafts_padding_and_mixed_counts() -> None:
    p = torch.zeros(3, 4, 5)  # [B, K+1, V], one-hot so every outcome is known
    p[:, :, 2] = 1.0
    p[1, 1] = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    drafts = torch.tensor([[PAD, PAD, PAD], [2, 2, PAD], [2, 4, PAD]])
    q = torch.full((3, 3, 5), 0.2)
    res = verify(drafts, [0, 2, 2], q, p, torch.zeros(3, 3), torch.full((3,), 0.5))
    assert res.tokens == [[2], [2, 3], [2, 2]]
    assert res.num_accepted == [0, 1, 1]


def test_greedy_target_is_exact_for_any_uniforms_and_draft() -> None:
    gen = torch.Generator().manual_seed(1)
    b, k, v = 4000, 4, 6
    target = torch.randint(0, v, (b, k + 1), generator=gen)  # argmax per position
    p = torch.zeros(b, k + 1, v).scatter_(2, target[..., None], 1.0)  # [B, K+1, V]
    agree = torch.rand(b, k, generator=gen) < 0.7
    drafts = torch.where(agree, target[:, :k], torch.randint(0, v, (b, k), generator=gen))
    q = torch.softmax(torch.randn(b, k, v, generator=gen) * 4, -1)  # may give q(t) ~ 0 or ~ 1
    q[:7] = torch.zeros(7, k, v).scatter_(2, target[:7, :k, None], 1.0)  # q(argmax) = 1
    num = torch.randint(0, k + 1, (b,), generator=gen).tolist()
    u_acc = torch.rand(b, k, generator=gen, dtype=torch.float64)
    u_acc[:100] = 1.0 - 2.0**-53
    u_s = torch.rand(b, generator=gen, dtype=torch.float64)
    for q_in in (q, None):
        res = verify(drafts, num, q_in, p, u_acc, u_s)
        for row in range(b):
            match = 0
            while match < num[row] and drafts[row, match] == target[row, match]:
                match += 1
            expected = drafts[row, :match].tolist() + [int(target[row, match])]
            assert res.tokens[row] == expected and res.num_accepted[row] == match


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"num_draft": [3]}, "num_draft"),
        ({"target_probs": torch.full((1, 2, 4), 0.25)}, "target_probs"),
        ({"draft_probs": torch.full((1, 2, 4), 0.25)}, "draft_probs"),
        ({"accept_uniforms": torch.zeros(1, 3)}, "accept_uniforms"),
        ({"sample_uniforms": torch.zeros(2)}, "sample_uniforms"),
    ],
)
def test_verify_rejects_bad_shapes(kwargs: dict, word: str) -> None:
    args = {"draft_tokens": torch.zeros(1, 2, dtype=torch.long), "num_draft": [2],
            "draft_probs": torch.full((1, 2, 4), 0.25), "target_probs": torch.full((1, 3, 4), 0.25),
            "accept_uniforms": torch.zeros(1, 2), "sample_uniforms": torch.zeros(1)}
    args.update(kwargs)
    if word == "draft_probs":
        args["draft_probs"] = torch.full((1, 2, 5), 0.2)
    with pytest.raises(ValueError, match=word):
        verify(**args)


def test_empirical_acceptance_rate_and_recovery_single_position() -> None:
    n = 100_000
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    drafts = torch.zeros(n, 1, dtype=torch.long)  # always propose token 0: p/q = 0.25
    res = verify(drafts, [1] * n, q.expand(n, 1, 4), p.expand(n, 2, 4),
                 torch.rand(n, 1, generator=gen, dtype=torch.float64),
                 torch.rand(n, generator=gen, dtype=torch.float64))
    accepted = torch.tensor(res.num_accepted)
    assert abs(accepted.double().mean().item() - 0.25) < 0.01
    recovered = torch.tensor([t[0] for t, a in zip(res.tokens, res.num_accepted) if a == 0])
    freq = torch.bincount(recovered, minlength=4).double() / len(recovered)
    expected = residual_distribution(p, q)  # [0, 0, 1/4, 3/4]
    assert freq[0] == 0 and freq[1] == 0
    assert 0.5 * (freq - expected).abs().sum() < TV_BOUND


# ---------------------------------------------------------------- speculative decoding simulation


def _inverse_cdf(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Independent reference sampler: q [A, V] -> [A], the first index with cdf >= u * total."""
    cdf = q.double().cumsum(-1)  # [A, V]
    u = 1.0 - torch.rand(q.shape[0], 1, generator=gen, dtype=torch.float64)  # (0, 1]: never a zero-prob token
    return (cdf < u * cdf[:, -1:]).sum(-1)


def _draft(q_tab: torch.Tensor, grp: torch.Tensor, start: torch.Tensor, prev: torch.Tensor, k: int,
           gen: torch.Generator, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive draft of k tokens per row -> tokens [A, k], q [A, k, V]."""
    tokens, dists = [], []
    for i in range(k):
        q = q_tab[grp, start + i, prev]  # [A, V]
        t = q.argmax(-1) if deterministic else _inverse_cdf(q, gen)
        tokens.append(t)
        dists.append(q)
        prev = t
    a, v = prev.shape[0], q_tab.shape[-1]
    if k == 0:
        return torch.empty(a, 0, dtype=torch.long), torch.empty(a, 0, v)
    return torch.stack(tokens, 1), torch.stack(dists, 1)


def _round(p_tab: torch.Tensor, q_tab: torch.Tensor, grp: torch.Tensor, start: torch.Tensor,
           prev: torch.Tensor, k: int, gen: torch.Generator, deterministic: bool, random_k: bool,
           verifier: Verifier) -> tuple[torch.Tensor, torch.Tensor, VerifyResult]:
    """One speculative round for A rows -> (drafts [A, k], num_draft [A], result)."""
    a = grp.shape[0]
    drafts, q_rows = _draft(q_tab, grp, start, prev, k, gen, deterministic)  # [A, k], [A, k, V]
    num = torch.randint(0, k + 1, (a,), generator=gen) if random_k else torch.full((a,), k)
    padded = torch.where(torch.arange(k)[None, :] < num[:, None], drafts, PAD)  # [A, k]
    prevs = torch.cat([prev[:, None], drafts], 1)  # [A, k+1]: token before each verified slot
    p_rows = p_tab[grp[:, None], start[:, None] + torch.arange(k + 1), prevs]  # [A, k+1, V]
    res = verifier(padded, num.tolist(), None if deterministic else q_rows, p_rows,
                   torch.rand(a, k, generator=gen, dtype=torch.float64),
                   torch.rand(a, generator=gen, dtype=torch.float64))
    return drafts, num, res


def simulate(p_tab: torch.Tensor, q_tab: torch.Tensor, groups: torch.Tensor, k: int, seed: int, *,
             deterministic: bool = False, random_k: bool = False,
             verifier: Verifier = verify) -> tuple[torch.Tensor, int, int]:
    """Generate LENGTH tokens per row by speculative rounds.

    p_tab, q_tab [G, LENGTH + k, V, V]: entry (g, pos, prev) is the next-token distribution of
    group g at absolute position pos after token prev (token 0 precedes position 0).
    Returns (tokens [B, LENGTH], drafted, accepted).
    """
    gen = torch.Generator().manual_seed(seed)
    b = groups.shape[0]
    out = torch.zeros(b, LENGTH + k + 1, dtype=torch.long)  # [B, LENGTH + k + 1]
    pos, last = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)  # [B], [B]
    drafted = accepted = 0
    while (active := (pos < LENGTH).nonzero().squeeze(1)).numel():
        start = pos[active]
        drafts, num, res = _round(p_tab, q_tab, groups[active], start, last[active], k, gen,
                                  deterministic, random_k, verifier)
        n_acc = torch.tensor(res.num_accepted)  # [A]
        lens = torch.tensor([len(t) for t in res.tokens])  # [A]
        assert torch.equal(lens, n_acc + 1) and bool((n_acc <= num).all())
        flat = torch.tensor(list(itertools.chain.from_iterable(res.tokens)))  # [sum(lens)]
        local = torch.repeat_interleave(torch.arange(active.numel()), lens)  # [sum(lens)]
        offset = torch.arange(flat.numel()) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        is_draft = offset < n_acc[local]
        if k:  # accepted tokens are exactly the draft prefix
            assert torch.equal(flat[is_draft], drafts[local, offset.clamp(max=k - 1)][is_draft])
        out[active[local], start[local] + offset] = flat
        pos[active] += lens
        last[active] = out[active, pos[active] - 1]
        drafted += int(num.sum())
        accepted += int(n_acc.sum())
    return out[:, :LENGTH], drafted, accepted


def exact_marginals(p_tab: torch.Tensor) -> torch.Tensor:
    """[G, LENGTH, V] marginal of the target chain at each position (float64)."""
    p = p_tab.double()
    dist = p[:, 0, 0]  # [G, V]
    rows = [dist]
    for i in range(1, LENGTH):
        dist = torch.einsum("gv,gvw->gw", dist, p[:, i])
        rows.append(dist)
    return torch.stack(rows, 1)


def max_tv(tokens: torch.Tensor, groups: torch.Tensor, p_tab: torch.Tensor) -> float:
    """Largest total-variation distance, over groups and positions, of emitted vs exact marginals."""
    v = p_tab.shape[-1]
    exact = exact_marginals(p_tab)  # [G, LENGTH, V]
    worst = 0.0
    for g in range(p_tab.shape[0]):
        rows = tokens[groups == g]  # [n_g, LENGTH]
        for i in range(LENGTH):
            freq = torch.bincount(rows[:, i], minlength=v).double() / rows.shape[0]
            worst = max(worst, 0.5 * float((freq - exact[g, i]).abs().sum()))
    return worst


def _tables(v: int, k: int, seed: int, scale: float = 2.0,
            boost: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target logits and correlated draft logits, [1, LENGTH + k, V, V] each.

    `boost` raises 6 random tokens per position: the marginals concentrate a little, which
    keeps the sampling noise of the TV estimate well below the bound for V = 32 at 100k rows.
    """
    gen = torch.Generator().manual_seed(seed)
    favoured = torch.rand(1, LENGTH + k, 1, v, generator=gen).argsort(-1) < 6  # [1, P, 1, V]
    target = torch.randn(1, LENGTH + k, v, v, generator=gen) * scale + boost * favoured
    draft = target + torch.randn(1, LENGTH + k, v, v, generator=gen) * scale * 0.7
    return target, draft


def _probs_with(logits: torch.Tensor, params: SamplingParams, repetition_context: bool = False) -> torch.Tensor:
    """Apply a sampling pipeline to every table row; context = the previous token if asked."""
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)  # [rows, V]: the last table axis before V is the previous token
    contexts = [[r % v] for r in range(flat.shape[0])] if repetition_context else None
    return logits_to_probs(flat, [params] * flat.shape[0], contexts).reshape(logits.shape)


def _check_lossless(p_tab: torch.Tensor, q_tab: torch.Tensor, rows_per_group: int, k: int,
                    seed: int, **kw: bool) -> tuple[int, int]:
    groups = torch.arange(p_tab.shape[0]).repeat_interleave(rows_per_group)
    tokens, drafted, accepted = simulate(p_tab, q_tab, groups, k, seed, **kw)
    tv = max_tv(tokens, groups, p_tab)
    assert tv < TV_BOUND, f"emitted tokens deviate from the target: TV {tv:.4f}"
    return drafted, accepted


def test_lossless_random_distributions_v32_k4() -> None:
    target, draft = _tables(32, 4, seed=10, boost=4.0)
    drafted, accepted = _check_lossless(torch.softmax(target, -1), torch.softmax(draft, -1), 100_000, 4, 11)
    assert 0.2 < accepted / drafted < 0.95  # both accept and reject paths are exercised


def test_lossless_disjoint_supports_and_random_draft_lengths() -> None:
    v, k = 8, 3
    gen = torch.Generator().manual_seed(20)
    target, draft = _tables(v, k, seed=21)
    p_keep = torch.rand(target.shape, generator=gen) > 0.35  # p = 0 where q may be > 0
    q_keep = torch.rand(target.shape, generator=gen) > 0.35  # q = 0 where p may be > 0
    p_keep[..., 0] = q_keep[..., 1] = True  # each row keeps some mass
    p = torch.softmax(target.masked_fill(~p_keep, float("-inf")), -1)
    q = torch.softmax(draft.masked_fill(~q_keep, float("-inf")), -1)
    assert ((p == 0) & (q > 0)).any() and ((q == 0) & (p > 0)).any()
    _check_lossless(p, q, 100_000, k, 22, random_k=True)


def test_lossless_and_always_accepted_when_p_equals_q() -> None:
    target, _ = _tables(16, 4, seed=30)
    p = torch.softmax(target, -1)
    drafted, accepted = _check_lossless(p, p.clone(), 100_000, 4, 31)
    assert accepted == drafted


def test_lossless_with_deterministic_proposals() -> None:
    target, draft = _tables(16, 4, seed=40)
    drafted, accepted = _check_lossless(torch.softmax(target, -1), torch.softmax(draft, -1), 100_000, 4,
                                        41, deterministic=True)
    assert 0 < accepted < drafted


def test_lossless_with_top_k_top_p_truncated_distributions() -> None:
    target, draft = _tables(32, 3, seed=50, scale=1.0)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    p, q = _probs_with(target, params), _probs_with(draft, params)
    assert int((p > 0).sum(-1).max()) <= 6 and bool(((p > 0) != (q > 0)).any())
    _check_lossless(p, q, 100_000, 3, 51)


def test_lossless_mixed_parameters_in_one_batch_and_greedy_rows_exact() -> None:
    v, k = 16, 3
    target, draft = _tables(v, k, seed=60, scale=1.0)
    settings = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=4),
                SamplingParams(temperature=1.7, top_p=0.8, repetition_penalty=1.5),
                SamplingParams(temperature=0.0)]
    p = torch.cat([_probs_with(target, s, repetition_context=True) for s in settings])  # [4, ...]
    # the draft of the greedy group samples at temperature 1 (not one-hot)
    q_settings = settings[:3] + [SamplingParams(temperature=1.0)]
    q = torch.cat([_probs_with(draft, s, repetition_context=True) for s in q_settings])
    groups = torch.arange(4).repeat_interleave(torch.tensor([100_000] * 3 + [20_000]))
    tokens, _, _ = simulate(p, q, groups, k, 61, random_k=True)
    assert max_tv(tokens, groups, p) < TV_BOUND
    chain, prev = [], 0  # the greedy target sequence
    for i in range(LENGTH):
        prev = int(p[3, i, prev].argmax())
        chain.append(prev)
    assert bool((tokens[groups == 3] == torch.tensor(chain)).all())


def _accept_all(draft_tokens: torch.Tensor, num_draft: list[int], draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, accept_uniforms: torch.Tensor,
                sample_uniforms: torch.Tensor) -> VerifyResult:
    """A deliberately wrong verifier: keeps every draft, then a bonus token from p."""
    n = torch.tensor(num_draft)
    bonus = sample_from_probs(target_probs[torch.arange(len(num_draft)), n], sample_uniforms)
    tokens = [draft_tokens[b, :c].tolist() + [int(bonus[b])] for b, c in enumerate(num_draft)]
    return VerifyResult(tokens=tokens, num_accepted=list(num_draft))


def test_negative_control_accept_all_verifier_fails_the_same_check() -> None:
    target, draft = _tables(16, 3, seed=70)
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    groups = torch.zeros(100_000, dtype=torch.long)
    wrong, _, _ = simulate(p, q, groups, 3, 71, verifier=_accept_all)
    assert max_tv(wrong, groups, p) > 5 * TV_BOUND  # the check detects a lossy verifier


def test_verify_logits_greedy_rows_accept_the_argmax_prefix():
    # the fused verification (one-hot targets for greedy rows, zero uniforms) against the rule
    # written out: keep drafts while they equal the argmax, then emit the argmax
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 6
    logits = torch.randn(b, k + 1, v, generator=g)
    argmax = logits.argmax(dim=-1)
    draft = torch.where(torch.rand(b, k, generator=g) < 0.6, argmax[:, :k], torch.randint(0, v, (b, k), generator=g))
    num = torch.randint(0, k + 1, (b,), generator=g)
    rows = verify_logits(logits, torch.ones(b), torch.ones(b, dtype=torch.bool), draft, num, None,
                         torch.zeros(b, k + 1, dtype=torch.float64)).tolist()
    assert verify_greedy_logits(logits, draft, num).tolist() == rows  # the greedy-only shortcut
    result = unpack_rows(rows)
    for i in range(b):
        n = 0
        while n < num[i] and draft[i, n] == argmax[i, n]:
            n += 1
        assert result.num_accepted[i] == n
        assert result.tokens[i] == draft[i, :n].tolist() + [argmax[i, n].item()]


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_logits_equals_the_general_pipeline(with_q):
    # temperature-only rows (greedy among them): the fused path must give exactly what
    # logits_to_probs + verify give with the same uniforms
    g = torch.Generator().manual_seed(1)
    b, k, v = 48, 3, 9
    temps = [0.0, 0.7, 1.0, 1.6] * (b // 4)
    params = [SamplingParams(temperature=t) for t in temps]
    logits = torch.randn(b, k + 1, v, generator=g) * 2
    q = torch.softmax(torch.randn(b, k, v, generator=g), dim=-1) if with_q else None
    draft = torch.randint(0, v, (b, k), generator=g)
    num = torch.randint(1, k + 1, (b,), generator=g)
    u = torch.rand(b, k + 1, generator=g, dtype=torch.float64)
    fused = unpack_rows(verify_logits(logits, torch.tensor([t or 1.0 for t in temps]),
                                      torch.tensor([t == 0 for t in temps]), draft, num, q, u).tolist())
    flat = [p for p in params for _ in range(k + 1)]
    p = logits_to_probs(logits.reshape(b * (k + 1), v), flat, None).view(b, k + 1, v)
    general = verify(draft, num.tolist(), q, p, u[:, :k], u[:, k])
    assert fused == general
    assert 0 < sum(general.num_accepted) < int(num.sum())  # some accepted, some rejected
