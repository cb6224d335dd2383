"""Kernel bundles: compiled bundles are per model signature (no compile on the CPU here;
tests/gpu checks that compiled kernels match the eager ones)."""

from __future__ import annotations

from infer.models.kernels.bundle import compiled_kernels


def _code(fn):
    return getattr(fn, "_torchdynamo_orig_callable", fn).__code__


def test_one_compiled_bundle_per_key_with_its_own_code_objects():
    a1, a2, b = compiled_kernels(("a", 1)), compiled_kernels(("a", 1)), compiled_kernels(("b", 2))
    assert a1 is a2  # engines of the same model share compiled variants
    assert b is not a1
    # separate code objects: separate torch.compile caches and recompile limits per model
    assert _code(a1.rmsnorm) is not _code(b.rmsnorm)
    assert _code(a1.rmsnorm).co_code == _code(b.rmsnorm).co_code
