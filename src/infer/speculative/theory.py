"""The paper's speed model (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", section 3) as pure functions, the one home of these formulas:
`expected_tokens` (Eq. 1), `walltime_factor` (Theorem 3.8, with a measured v(K)), `best_k` and
its tables, `alpha_from_mean_length`, the static-tree forms. docs/speculation.md, "The speed model".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _check(a: float, k: int) -> None:
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens per round, (1 - a^(k+1)) / (1 - a) (Eq. 1); k + 1 at a = 1."""
    _check(a, k)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def walltime_factor(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding (Theorem 3.8; `verify_cost` = v(K))."""
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"need c >= 0 and verify_cost > 0, got c={c}, verify_cost={verify_cost}")
    return expected_tokens(a, k) / (k * c + verify_cost)


def best_k(a: float, k_max: int, c: float, verify_cost: Callable[[int], float] = lambda k: 1.0) -> tuple[int, float]:
    """(K, its walltime factor) maximising the factor over K = 0..k_max (K = 0: factor 1); ties: the smallest K."""
    return best_k_table([a], k_max, c, [verify_cost(k) for k in range(1, k_max + 1)])[0]


def best_k_table(alphas: Sequence[float], k_max: int, c: float, verify_costs: Sequence[float]
                 ) -> list[tuple[int, float]]:
    """`best_k` for each a in `alphas` with v(K) = verify_costs[K - 1]."""
    return best_k_grid(alphas, k_max, c, [verify_costs])[0]


GRID_ROWS = 128  # verify-cost rows computed at once (bounds the [rows, alphas, K] factors)


def best_k_grid(alphas: Sequence[float], k_max: int, c: float, verify_rows: Sequence[Sequence[float]]
                ) -> list[list[tuple[int, float]]]:
    """`best_k_table` for each row of verify costs, computed together; the factors are exactly
    `walltime_factor`'s (the same float64 operations), K chosen by `best_k`'s rule."""
    if c < 0 or any(len(row) != k_max or any(v <= 0 for v in row) for row in verify_rows):
        raise ValueError(f"need rows of k_max = {k_max} verify costs > 0 and c >= 0, got c={c}")
    tokens = torch.tensor([[expected_tokens(a, k) for k in range(1, k_max + 1)] for a in alphas],
                          dtype=torch.float64)  # [A, K]
    ks = torch.arange(1, k_max + 1, dtype=torch.float64)  # [K]
    tables: list[list[tuple[int, float]]] = []
    for lo in range(0, len(verify_rows), GRID_ROWS):
        costs = ks * c + torch.tensor(verify_rows[lo:lo + GRID_ROWS], dtype=torch.float64)  # [R, K]
        factors = tokens[None] / costs[:, None]  # [R, A, K]
        best = torch.zeros(factors.shape[:2], dtype=torch.long)  # [R, A]: K = 0 (plain) ...
        best_factor = torch.ones(factors.shape[:2], dtype=torch.float64)  # ... with factor 1
        for k in range(k_max):  # a longer K must beat the best so far by 1e-12 (the smallest among equals)
            better = factors[..., k] > best_factor + 1e-12
            best = torch.where(better, k + 1, best)
            best_factor = torch.where(better, factors[..., k], best_factor)
        tables += [list(zip(b, f, strict=True)) for b, f in zip(best.tolist(), best_factor.tolist(), strict=True)]
    return tables


def alpha_from_mean_length(mean_length: float, k: int, tol: float = 1e-10) -> float:
    """The a in [0, 1] with expected_tokens(a, k) == mean_length (clamped to the range)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if mean_length <= 1.0:
        return 0.0
    if mean_length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0  # expected_tokens is increasing in a
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def tree_expected_tokens(a: float, branching: Sequence[int]) -> float:
    """Expected tokens per round of a static tree, each child tried accepted with probability a."""
    _check(a, len(branching))
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"branching must be one or more counts >= 1, got {tuple(branching)}")
    total, reach = 1.0, 1.0
    for b in branching:
        reach *= 1.0 - (1.0 - a) ** b
        total += reach
    return total


def tree_walltime_factor(a: float, branching: Sequence[int], c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup of a static tree: expected tokens over depth x c + `verify_cost` (v(N))."""
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"need c >= 0 and verify_cost > 0, got c={c}, verify_cost={verify_cost}")
    return tree_expected_tokens(a, branching) / (len(branching) * c + verify_cost)
