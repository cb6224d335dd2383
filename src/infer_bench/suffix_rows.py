"""The `speculation` suite's suffix decoding rows: suffix decoding against prompt lookup
and plain decoding on W5 (beside its n-gram rows) and on the agent workload."""

from __future__ import annotations

from typing import Any

from infer_bench.measures import engine_row
from infer_bench.rows import Need, Row
from infer_bench.workloads import WORKLOADS
from infer.engine.config import SUFFIX_SPEC_LENGTH


def suffix_rows(plain: dict[str, Any], spec_k: int, needs: tuple[Need, ...]) -> list[Row]:
    """Suffix decoding (its defaults: chains; and branching trees) on W5 beside the n-gram
    rows, and on the agent workload against plain decoding and prompt lookup (at `spec_k`
    and at suffix's K); each
    "-vs-prompt-lookup" row alternates with prompt lookup at `spec_k` (its x baseline:
    suffix over prompt lookup, paired). `plain`: the plain rows' engine options."""
    lookup = {**plain, "use_speculative_decoding": True, "speculative_method": "prompt_lookup", "spec_length": spec_k}
    suffix = {**plain, "speculative_method": "suffix"}
    w5, tag = WORKLOADS["W5"].with_temperature(0.0), "w5-ngram-t0"
    group = "demo target, W5 T=0, n-gram drafts"
    trees = {**suffix, "spec_tree": "dynamic:16"}  # up to 4 children a node
    rows = [engine_row(f"{tag}/suffix", f"suffix decoding (K={SUFFIX_SPEC_LENGTH}, chains)", group, w5, suffix,
                       {"baseline": f"{tag}/plain"}, needs=needs),
            engine_row(f"{tag}/suffix-trees", "suffix decoding, trees of up to 16 nodes (4 children a node)", group,
                       w5, trees, {"baseline": f"{tag}/plain"}, needs=needs),
            engine_row(f"{tag}/suffix-vs-prompt-lookup", f"suffix decoding, paired with prompt lookup K={spec_k} (x "
                       "baseline: over prompt lookup)", group, w5, suffix, {"baseline": f"{tag}/prompt-lookup-k{spec_k}"},
                       paired_with=lookup, needs=needs)]
    agent, tag = WORKLOADS["agent"].with_temperature(0.0), "agent-t0"
    group, base = "demo target, agent workload T=0", "agent-t0/plain"
    return rows + [
        engine_row(base, "plain decoding, 16 tool-calling requests one after another", group, agent, plain,
                   needs=needs),
        engine_row(f"{tag}/prompt-lookup-k{spec_k}", f"prompt lookup, fixed K={spec_k}", group, agent, lookup, {"baseline": base},
                   needs=needs),
        engine_row(f"{tag}/prompt-lookup-k{SUFFIX_SPEC_LENGTH}", f"prompt lookup, fixed K={SUFFIX_SPEC_LENGTH} "
                   "(suffix decoding's K)", group, agent, {**lookup, "spec_length": SUFFIX_SPEC_LENGTH},
                   {"baseline": base}, needs=needs),
        engine_row(f"{tag}/suffix", "suffix decoding: the request's own tokens and the earlier outputs", group,
                   agent, suffix, {"baseline": base}, needs=needs),
        engine_row(f"{tag}/suffix-no-cache", "suffix decoding without the cache of earlier outputs", group, agent,
                   {**suffix, "spec_suffix_cache_tokens": 0}, {"baseline": base}, needs=needs),
        engine_row(f"{tag}/suffix-trees", "suffix decoding, trees of up to 16 nodes (4 children a node)", group,
                   agent, trees, {"baseline": base}, needs=needs),
        engine_row(f"{tag}/suffix-vs-prompt-lookup", f"suffix decoding, paired with prompt lookup K={spec_k} (x baseline: "
                   "over prompt lookup)", group, agent, suffix, {"baseline": f"{tag}/prompt-lookup-k{spec_k}"},
                   paired_with=lookup, needs=needs)]
