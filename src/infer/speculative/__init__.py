"""Speculative decoding: proposers (draft model, n-gram), rejection sampling, length policy, metrics."""
