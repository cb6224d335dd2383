"""What the adaptive policy did, generation by generation, on fresh engines (GPU machine).

For each of `--instances` fresh adaptive engines on the demo pair (draft model or n-gram),
W1 prompt, one generation after another at each temperature in turn (as the A/B runs them):
per generation the milliseconds a token, rounds, the rounds that followed plain steps
(probes and switches back), with the K drafted and accepted of the first few, and at the end of
the generation the greedy and sampled priors the policy learned and its r(K) in the
generation's sampling mode. Tells an instance that never starts speculating (its probes'
K, acceptance and prices) from one that starts late.

    PYTHONPATH=src python scripts/policy_trace.py [--method draft] [--instances 3] [--generations 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plain_step_ab import ms_per_token  # noqa: E402

from infer.bench.workloads import WORKLOADS, build_requests  # noqa: E402
from infer.engine.config import EngineConfig  # noqa: E402
from infer.engine.engine import Engine  # noqa: E402
from infer.engine.loading import DEMO_DRAFT, DEMO_TARGET  # noqa: E402


def trace(engine: Engine, prompt: list[int], temperature: float, tokens: int) -> str:
    """One generation; a line on what the policy did in it."""
    runner = engine.runner
    policy = runner.policy
    log: list[tuple[int, int, int, bool]] = []  # (policy step, K, accepted, after plain steps)
    last = [-2]
    update = policy.update

    def logged(request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft:
            log.append((policy._steps, num_draft, num_accepted, policy._steps - last[0] > 1))
            last[0] = policy._steps
        update(request_id, num_draft, num_accepted)

    policy.update = logged
    try:
        ms = ms_per_token(engine, prompt, temperature, tokens)
    finally:
        del policy.update
    firsts = [(k, a) for _, k, a, first in log if first]
    sampled = temperature > 0
    costs = runner.cost_model.relative_costs(1, sampled)
    return (f"{ms:.3f} ms/token, {len(log)} rounds ({sum(a for _, _, a, _ in log)} accepted), "
            f"{len(firsts)} after plain steps (K, accepted) {firsts[:6]}{' ...' if len(firsts) > 6 else ''}; "
            f"learned priors greedy {policy.prior(False):.3f} sampled {policy.prior(True):.3f}; "
            f"r(K) {[round(x, 2) for x in costs]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["draft", "ngram"], default="draft")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--generations", type=int, default=6)
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    base = dict(model=str(DEMO_TARGET), use_cuda_graphs=True, max_batch_size=1, max_seq_len=1024,
                use_speculative_decoding=True, spec_length=5, spec_policy="adaptive")
    method = dict(draft_model=str(DEMO_DRAFT)) if args.method == "draft" else dict(speculative_method="ngram")
    for i in range(args.instances):
        engine = Engine(EngineConfig(**base, **method))
        prompt = build_requests(WORKLOADS["W1"], engine.vocab_size, engine.tokenizer).requests[0].prompt_ids
        for t in args.temperature:
            for g in range(args.generations):
                print(f"{args.method}#{i} W1 T={t:g} generation {g}: {trace(engine, prompt, t, args.tokens)}",
                      flush=True)


if __name__ == "__main__":
    main()
