"""A request's random draws: its CPU generator (seeded, or not), the seeds of its `n`
samples, and the float64 uniforms sampling and verification invert."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling.params import SEED_MAX, SEED_MIN, is_strict_int


def derive_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request's `n`: `seed` itself for index 0, a splitmix64 mix of
    both otherwise; None stays None."""
    if seed is None or index == 0:
        return seed
    mask = 2**64 - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1  # in [0, 2**63)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded with `seed`, or from a nondeterministic source when None."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
        return gen
    if not is_strict_int(seed) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {seed!r}")
    gen.manual_seed(seed)
    return gen


def draw_uniforms(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """[len(generators), n] float64 uniforms in [0, 1) on CPU; row i comes from generators[i]."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not generators:
        return torch.empty(0, n, dtype=torch.float64)
    rows = [torch.rand(n, generator=g, dtype=torch.float64) for g in generators]  # each [n]
    return torch.stack(rows)


def round_uniforms(generators: Sequence[torch.Generator], counts: Sequence[int], width: int) -> torch.Tensor:
    """[len(generators), width + 1] float64 uniforms for a verification round: row i draws exactly
    counts[i] + 1 from generators[i], columns 0..counts[i]-1 to accept, column `width` to sample."""
    out = torch.zeros((len(generators), width + 1), dtype=torch.float64)
    for i, (g, k) in enumerate(zip(generators, counts, strict=True)):
        row = torch.rand(k + 1, generator=g, dtype=torch.float64)
        out[i, :k] = row[:k]
        out[i, width] = row[k]
    return out
